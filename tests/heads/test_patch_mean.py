"""``pooling="patch_mean"`` averages a vision backbone's patch tokens, without its CLS and
register tokens, and so reproduces HF's image classifiers that pool that way:

- ``Dinov2ForImageClassification`` (and its registers variant): the CLS token of
  ``last_hidden_state`` concatenated with the mean of its patch tokens: ``"first+patch_mean"``
  with ``last_hidden_state=True`` (DINOv2's ``hidden_states[-1]`` is taken before its final
  layernorm);
- ``CLIPForImageClassification``: the mean of the patch tokens of ``last_hidden_state``
  (before ``post_layernorm``, which only its pooled output gets): ``"patch_mean"`` on the last
  layer.

Each test copies the HF classifier's weights into the head and compares logits exactly.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import IMAGE_SIZE, REGISTERS, build_tiny, tiny_config

from headkit import HeadConfig, HeadedModel
from headkit.errors import ConfigError

LABELS = 3


def _pixels(n: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(seed))


def _copy(head_linear: torch.nn.Linear, hf_linear: torch.nn.Linear) -> None:
    with torch.no_grad():
        head_linear.weight.copy_(hf_linear.weight)
        head_linear.bias.copy_(hf_linear.bias)


@pytest.mark.parametrize(("arch", "special"), [("dinov2", 1), ("dinov2-registers", 1 + REGISTERS)])
def test_first_plus_patch_mean_reproduces_dinov2_for_image_classification(arch, special):
    hf = build_tiny(arch, 2, task="image-classification", num_labels=LABELS)
    head = HeadConfig(
        "cls",
        pred_for_sequence=True,
        pooling="first+patch_mean",
        last_hidden_state=True,
        num_outputs=LABELS,
        output_bias=True,
    )
    model = HeadedModel(hf, [head]).eval()
    assert model.info.special_tokens == special  # CLS (+ the registers), read from the model
    _copy(model.heads["cls"].output_projection(), hf.classifier)
    pixels = _pixels()
    with torch.no_grad():
        want = hf(pixel_values=pixels).logits
        got = model(pixel_values=pixels).logits
    assert torch.equal(got, want)


def _clip_classifier() -> transformers.CLIPForImageClassification:
    vision = tiny_config("clip-vision", 2).to_dict()
    text = {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64}
    config = transformers.CLIPConfig(vision_config=vision, text_config=text, num_labels=LABELS)
    torch.manual_seed(0)
    return transformers.CLIPForImageClassification(config).eval()


def test_patch_mean_reproduces_clip_for_image_classification():
    hf = _clip_classifier()
    head = HeadConfig(
        "cls", pred_for_sequence=True, pooling="patch_mean", num_outputs=LABELS, output_bias=True
    )
    model = HeadedModel(hf.vision_model, [head]).eval()
    assert model.info.special_tokens == 1
    _copy(model.heads["cls"].output_projection(), hf.classifier)
    pixels = _pixels()
    with torch.no_grad():
        want = hf(pixel_values=pixels).logits
        got = model(pixel_values=pixels).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # the plain mean (every token, CLS too) is what headkit had before: not HF's classifier
    mean = HeadedModel(hf.vision_model, [head.replace(pooling="mean")]).eval()
    _copy(mean.heads["cls"].output_projection(), hf.classifier)
    with torch.no_grad():
        assert not torch.allclose(mean(pixel_values=pixels).logits, want)


def test_patch_mean_on_siglip_is_the_mean_of_every_position():
    """SigLIP's vision tower has no CLS token: every position is a patch."""
    backbone = build_tiny("siglip-vision", 2)
    heads = [
        HeadConfig(p, pred_for_sequence=True, pooling=p, last_hidden_state=True)
        for p in ("patch_mean", "mean")
    ]
    model = HeadedModel(backbone, heads).eval()
    assert model.info.special_tokens == 0
    feats = model.heads["patch_mean"].features
    hf = backbone(pixel_values=_pixels()).last_hidden_state
    torch.testing.assert_close(feats(hf), hf.mean(1))
    assert torch.equal(feats(hf), model.heads["mean"].features(hf))


def test_patch_mean_on_a_text_backbone_is_refused():
    with pytest.raises(ConfigError, match=r"pooling='patch_mean' averages the image patches"):
        HeadedModel(
            build_tiny("bert", 2), [HeadConfig("h", pred_for_sequence=True, pooling="patch_mean")]
        )
