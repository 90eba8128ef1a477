"""More families the README names, each checked the same way: Mistral, Qwen2 and Gemma
(left-padded), DINOv2 (with and without register tokens), SigLIP's vision tower, HuBERT,
WavLM, mBART (both stacks) and Idefics3 (SmolVLM). A pooled head and a token (patch,
frame) head equal the same pooling of HF's own ``output_hidden_states`` at a middle and at
the last layer (speech at the model's own frame mask; T5 and BART also left-padded), early
exit runs only the blocks a head needs and still equals HF there, and a checkpoint reloads
predicting identically. Hierarchical models (Swin) are refused."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from conftest import IDEFICS3_IMAGE_TOKENS, IMAGE_SIZE, IMAGE_TOKEN, REGISTERS, build_tiny
from tiny_media import assert_heads_match_hf, planted_audio, speech_feature_extractor

from headkit import ConfigError, HeadConfig, HeadedModel

pytestmark = pytest.mark.usefixtures("single_thread")

LAYERS = 3
MIDDLE = 2


def _images() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)}


def _padded_audio() -> dict[str, torch.Tensor]:
    """Two clips of 1,200 and 700 samples, right-padded, with the sample-level mask."""
    clips, _ = planted_audio(2)
    return dict(
        speech_feature_extractor()(
            [clips[0][:1200], clips[1][:700]],
            sampling_rate=16_000,
            padding=True,
            return_tensors="pt",
        )
    )


def _left_padded_ids() -> dict[str, torch.Tensor]:
    """Three prompts of 7, 5 and 2 tokens, left-padded (as decoders are batched to generate)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 100, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :5] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def _left_padded_pair() -> dict[str, torch.Tensor]:
    """Encoder and decoder token ids, each left-padded in its second row."""
    batch = _text_pair()
    batch["attention_mask"] = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    batch["decoder_attention_mask"] = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    return batch


def _text_pair() -> dict[str, torch.Tensor]:
    """Encoder and decoder token ids, each right-padded in its second row."""
    g = torch.Generator().manual_seed(3)
    return {
        "input_ids": torch.randint(3, 100, (2, 6), generator=g),
        "attention_mask": torch.tensor([[1] * 6, [1] * 4 + [0] * 2]),
        "decoder_input_ids": torch.randint(3, 100, (2, 4), generator=g),
        "decoder_attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
    }


def _image_prompts() -> dict[str, torch.Tensor]:
    """Two prompts with one image each (its merged image tokens), the second left-padded."""
    g = torch.Generator().manual_seed(0)
    image = torch.full((2, IDEFICS3_IMAGE_TOKENS), IMAGE_TOKEN)
    ids = torch.cat([torch.ones(2, 1, dtype=torch.long), image, torch.randint(4, 40, (2, 4))], 1)
    ids[1] = torch.cat([torch.zeros(2, dtype=torch.long), ids[1, :-2]])
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    pixels = torch.randn(2, 1, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)  # one image per prompt
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels}


@dataclass(frozen=True)
class Family:
    """A family under test: its tiny architecture, a batch, the class of the blocks headkit
    runs (the language model's for a vision-language model) and its stacks."""

    arch: str
    batch: Callable[[], dict[str, torch.Tensor]]
    block: str
    stacks: tuple[str, ...] = ("encoder",)
    decoder_block: str | None = None


FAMILIES = {
    f.arch: f
    for f in (
        Family("mistral", _left_padded_ids, "MistralDecoderLayer"),
        Family("qwen2", _left_padded_ids, "Qwen2DecoderLayer"),
        Family("gemma", _left_padded_ids, "GemmaDecoderLayer"),
        Family("dinov2", _images, "Dinov2Layer"),
        Family("dinov2-registers", _images, "Dinov2WithRegistersLayer"),
        Family("siglip-vision", _images, "SiglipEncoderLayer"),
        Family("hubert", _padded_audio, "HubertEncoderLayerStableLayerNorm"),
        Family("wavlm", _padded_audio, "WavLMEncoderLayerStableLayerNorm"),
        Family(
            "mbart", _text_pair, "MBartEncoderLayer", ("encoder", "decoder"), "MBartDecoderLayer"
        ),
        Family("idefics3", _image_prompts, "LlamaDecoderLayer"),
    )
}


def hf_states(
    backbone, batch: dict, stack: str
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """HF's own hidden states of ``stack`` for ``batch`` and the mask over their positions:
    the attention mask for tokens, the model's frame mask for speech, none for images."""
    with torch.no_grad():
        out = backbone(**batch, output_hidden_states=True)
    if stack == "decoder":
        return out.decoder_hidden_states, batch["decoder_attention_mask"]
    if hasattr(out, "encoder_hidden_states") and out.encoder_hidden_states is not None:
        return out.encoder_hidden_states, batch["attention_mask"]
    if "input_values" in batch:
        frames = out.hidden_states[0].shape[1]
        return out.hidden_states, backbone._get_feature_vector_attention_mask(
            frames, batch["attention_mask"]
        )
    return out.hidden_states, batch.get("attention_mask")


def _heads(family: Family) -> list[HeadConfig]:
    """A sequence head (the family's default pooling), a mean-pooled one and a token head at
    a middle and at the last layer of each stack."""
    heads = []
    for stack in family.stacks:
        for layer in (MIDDLE, -1):
            common = {"layer_hook": layer, "stack": stack, "num_outputs": 3, "loss_fct": None}
            heads += [
                HeadConfig(f"{stack}_default{layer}", pred_for_sequence=True, **common),
                HeadConfig(
                    f"{stack}_mean{layer}", pred_for_sequence=True, pooling="mean", **common
                ),
                HeadConfig(f"{stack}_token{layer}", **common),
            ]
    return heads


def _count_blocks(backbone, cls_name: str) -> tuple[list[int], list]:
    calls: list[int] = []
    blocks = [m for m in backbone.modules() if type(m).__name__ == cls_name]
    assert blocks, cls_name
    return calls, [b.register_forward_hook(lambda *_: calls.append(1)) for b in blocks]


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_heads_equal_the_same_pooling_of_hf_hidden_states(arch: str) -> None:
    _check_heads_equal_hf(FAMILIES[arch])


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_left_padded_encoder_and_decoder_inputs_equal_hf_states(arch: str) -> None:
    """Both stacks left-padded (as batches for generation often are)."""
    _check_heads_equal_hf(Family(arch, _left_padded_pair, "", ("encoder", "decoder")))


def _check_heads_equal_hf(family: Family) -> None:
    """Every head of ``_heads`` equals the same pooling of HF's own hidden states."""
    model = HeadedModel(build_tiny(family.arch, LAYERS), _heads(family))
    batch = family.batch()
    out = model(**batch)
    states, masks = {}, {}
    for stack in family.stacks:
        hidden, mask = hf_states(model.backbone, batch, stack)
        assert len(hidden) == LAYERS + 1
        for name, cfg in model.head_configs.items():
            if cfg.stack == stack:
                states[name] = hidden[cfg.layer_hook]
                masks[name] = mask
    assert_heads_match_hf(model, out, states, masks)
    if "input_values" in batch:  # padding reduced to frames: the second clip has fewer
        real = masks["encoder_token-1"].sum(1).tolist()
        assert real[0] > real[1] and masks["encoder_token-1"].shape[1] > real[1]


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_early_exit_runs_only_the_blocks_a_head_needs_and_equals_hf_there(arch: str) -> None:
    family = FAMILIES[arch]
    backbone = build_tiny(arch, LAYERS)
    batch = family.batch()
    hidden, mask = hf_states(HeadedModel(backbone, []).backbone, batch, "encoder")
    for layer, blocks in ((0, 0), (1, 1), (MIDDLE, MIDDLE), (-1, LAYERS)):
        model = HeadedModel(backbone, [HeadConfig("tok", layer_hook=layer, num_outputs=2)])
        calls, handles = _count_blocks(backbone, family.block)
        later = _count_blocks(backbone, family.decoder_block) if family.decoder_block else None
        try:
            out = model(**batch)
        finally:
            for h in handles + (later[1] if later else []):
                h.remove()
        assert len(calls) == blocks, (layer, len(calls))
        assert later is None or not later[0]  # encoder heads never run the decoder
        assert_heads_match_hf(model, out, {"tok": hidden[layer]}, {"tok": mask})


def test_decoder_heads_of_mbart_run_the_decoder_only_as_deep_as_needed() -> None:
    backbone = build_tiny("mbart", LAYERS)
    head = HeadConfig("v", layer_hook=1, stack="decoder", pred_for_sequence=True)
    model = HeadedModel(backbone, [head])
    encoder, encoder_handles = _count_blocks(backbone, "MBartEncoderLayer")
    decoder, decoder_handles = _count_blocks(backbone, "MBartDecoderLayer")
    try:
        model(**_text_pair())
    finally:
        for h in encoder_handles + decoder_handles:
            h.remove()
    assert (len(encoder), len(decoder)) == (LAYERS, 1)


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_a_checkpoint_reloads_predicting_identically(arch: str, tmp_path) -> None:
    family = FAMILIES[arch]
    heads = [h for h in _heads(family) if "_mean" not in h.name]
    model = HeadedModel(build_tiny(arch, LAYERS), heads)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.normal_()
    batch = family.batch()
    expected = model(**batch).preds_by_head
    model.save_pretrained(tmp_path / "ckpt")
    reloaded = HeadedModel.from_pretrained(tmp_path / "ckpt")
    assert type(reloaded.backbone) is type(model.backbone)
    got = reloaded(**batch).preds_by_head
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_dinov2_last_layer_is_before_its_final_norm_and_first_is_the_cls_token() -> None:
    """DINOv2's encoder records its hidden states without tying the last one to the model's
    output: ``hidden_states[-1]`` is the last block's output, and ``last_hidden_state=True``
    reads the normed output, whose CLS token is HF's ``pooler_output``."""
    for arch in ("dinov2", "dinov2-registers"):
        backbone = build_tiny(arch, LAYERS)
        heads = [
            HeadConfig("cls", pred_for_sequence=True, layer_hook=MIDDLE, num_outputs=2),
            HeadConfig("pooled", pred_for_sequence=True, last_hidden_state=True, num_outputs=2),
            HeadConfig("raw", layer_hook=-1, num_outputs=2),
        ]
        model = HeadedModel(backbone, heads)
        assert model.head_configs["cls"].pooling == "first"
        assert model.hooked_layers() == {"cls": MIDDLE, "pooled": LAYERS + 1, "raw": LAYERS}
        batch = _images()
        out = model(**batch)
        hf = backbone(**batch, output_hidden_states=True)
        assert not torch.allclose(hf.hidden_states[-1], hf.last_hidden_state)
        assert hf.hidden_states[0].shape[1] == 1 + (REGISTERS if "registers" in arch else 0) + 16
        expected = {
            "cls": model.heads["cls"].from_features(hf.hidden_states[MIDDLE][:, 0]),
            "pooled": model.heads["pooled"].from_features(hf.pooler_output),
            "raw": model.heads["raw"](hf.hidden_states[-1]),
        }
        for name, value in expected.items():
            torch.testing.assert_close(out.preds_by_head[name], value, msg=f"{arch} {name}")


def test_siglip_vision_pools_the_mean_by_default_and_its_attention_head_as_pooler() -> None:
    """SigLIP's vision tower has no CLS token: "mean" by default (the mean over patches of
    ``last_hidden_state`` is what SiglipForImageClassification classifies), and
    ``pooling="pooler"`` is its attention-pooling ("MAP") head, HF's ``pooler_output``."""
    backbone = build_tiny("siglip-vision", LAYERS)
    heads = [
        HeadConfig("default", pred_for_sequence=True, last_hidden_state=True, num_outputs=2),
        HeadConfig("map", pred_for_sequence=True, pooling="pooler", last_hidden_state=True),
        HeadConfig("map_middle", pred_for_sequence=True, pooling="pooler", layer_hook=MIDDLE),
    ]
    model = HeadedModel(backbone, heads)
    assert model.head_configs["default"].pooling == "mean"
    assert model.info.pooler is backbone.head
    batch = _images()
    out = model(**batch)
    hf = backbone(**batch, output_hidden_states=True)
    expected = {
        "default": model.heads["default"].from_features(hf.last_hidden_state.mean(1)),
        "map": model.heads["map"].from_features(hf.pooler_output),
        "map_middle": model.heads["map_middle"].from_features(
            backbone.head(hf.hidden_states[MIDDLE])
        ),
    }
    for name, value in expected.items():
        torch.testing.assert_close(out.preds_by_head[name], value, msg=name)
    without = build_tiny("siglip-vision", 2, vision_use_head=False)  # as inside some VLMs
    with pytest.raises(ConfigError, match=r"pooling='pooler' needs the backbone's pooler"):
        HeadedModel(without, [HeadConfig("h", pred_for_sequence=True, pooling="pooler")])


def test_a_hierarchical_vision_model_is_refused_saying_why() -> None:
    swin = build_tiny("swin")
    hf = swin(**_images(), output_hidden_states=True)
    widths = {tuple(h.shape[1:]) for h in hf.hidden_states}
    assert len(widths) > 1  # what headkit could not read with one head width
    with pytest.raises(
        ConfigError,
        match=r"SwinModel is a hierarchical model \(config\.depths=\[1, 1\]: 2 stages.*"
        r"not supported",
    ):
        HeadedModel(swin, [HeadConfig("h", pred_for_sequence=True)])
