"""Heads on vision encoders (ViT, CLIP's vision tower): pixel_values through the one input
stage, every patch counts, "first" is the CLS token, early exit, ViT's own classifier
reproduced, checkpoints and Trainer."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import IMAGE_SIZE, build_tiny
from tiny_media import (
    assert_compiles_like_eager,
    assert_heads_match_hf,
    heads_at_every_layer,
    image_processor,
    planted_images,
)
from transformers import TrainingArguments

from headkit import (
    BatchError,
    ConfigError,
    HeadConfig,
    HeadedCollator,
    HeadedModel,
    HeadedTrainer,
    load_headed,
)

pytestmark = pytest.mark.usefixtures("single_thread")

LAYERS = 3


def _images(n: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(seed))


def _every_layer(num_outputs: int = 5) -> list[HeadConfig]:
    return heads_at_every_layer(LAYERS, ("first", "mean", "max"), "patch", num_outputs)


def _count_blocks(model, cls_name: str) -> tuple[list[int], list]:
    calls: list[int] = []
    blocks = [m for m in model.modules() if type(m).__name__ == cls_name]
    handles = [b.register_forward_hook(lambda *_: calls.append(1)) for b in blocks]
    return calls, handles


@pytest.mark.parametrize("arch", ["vit", "clip-vision"])
def test_every_head_equals_the_same_pooling_of_hf_hidden_states(arch: str) -> None:
    backbone = build_tiny(arch, LAYERS)
    heads = [*_every_layer(), HeadConfig("out", last_hidden_state=True, num_outputs=5)]
    model = HeadedModel(backbone, heads)
    pixels = _images()
    out = model(pixel_values=pixels)
    hf = backbone(pixel_values=pixels, output_hidden_states=True)
    states = {n: hf.hidden_states[k] for n, k in model.hooked_layers().items() if n != "out"}
    states["out"] = hf.last_hidden_state  # after the final norm
    assert_heads_match_hf(model, out, states, None)  # images: every patch counts
    assert out.preds_by_head["patch2"].shape == (3, (IMAGE_SIZE // 8) ** 2 + 1, 5)


def test_layer_minus_one_is_hf_hidden_states_not_the_normed_output() -> None:
    backbone = build_tiny("vit", LAYERS)
    pixels = _images()
    hf = backbone(pixel_values=pixels, output_hidden_states=True)
    assert not torch.allclose(hf.hidden_states[-1], hf.last_hidden_state)  # ViT's final norm
    model = HeadedModel(
        backbone,
        [
            HeadConfig("minus1", num_outputs=4, pred_for_sequence=True),
            HeadConfig("normed", num_outputs=4, pred_for_sequence=True, last_hidden_state=True),
        ],
    )
    assert model.hooked_layers() == {"minus1": LAYERS, "normed": LAYERS + 1}
    out = model(pixel_values=pixels)
    for name, states in (("minus1", hf.hidden_states[-1]), ("normed", hf.last_hidden_state)):
        torch.testing.assert_close(out.preds_by_head[name], model.heads[name](states))


def test_first_pooling_is_the_cls_token_and_the_default_for_vision() -> None:
    backbone = build_tiny("vit", LAYERS)
    model = HeadedModel(backbone, [HeadConfig("cls", num_outputs=2, pred_for_sequence=True)])
    assert model.head_configs["cls"].pooling == "first"
    pixels = _images()
    hidden = backbone(pixel_values=pixels, output_hidden_states=True).hidden_states[-1]
    head = model.heads["cls"]
    torch.testing.assert_close(model(pixel_values=pixels).logits, head.from_features(hidden[:, 0]))


def test_a_head_reproduces_vit_for_image_classification_with_copied_weights() -> None:
    torch.manual_seed(0)
    hf = build_tiny("vit", LAYERS, task="image-classification", num_labels=4)
    cfg = HeadConfig(
        "label",
        num_outputs=4,
        pred_for_sequence=True,
        pooling="cls",
        last_hidden_state=True,  # ViT classifies the CLS token after its final norm
        output_bias=True,
    )
    model = HeadedModel(hf, [cfg])
    linear = model.heads["label"].output_projection()
    with torch.no_grad():
        linear.weight.copy_(hf.classifier.weight)
        linear.bias.copy_(hf.classifier.bias)
    pixels = _images(4)
    torch.testing.assert_close(model(pixel_values=pixels).logits, hf(pixel_values=pixels).logits)


@pytest.mark.parametrize(
    ("arch", "block"), [("vit", "ViTLayer"), ("clip-vision", "CLIPEncoderLayer")]
)
def test_early_exit_runs_only_the_vision_blocks_a_head_needs(arch: str, block: str) -> None:
    backbone = build_tiny(arch, 4)
    for layer, expected in ((0, 0), (1, 1), (3, 3), (-1, 4)):
        model = HeadedModel(backbone, [HeadConfig("h", layer_hook=layer, pred_for_sequence=True)])
        calls, handles = _count_blocks(backbone, block)
        try:
            model(pixel_values=_images(2))
        finally:
            for h in handles:
                h.remove()
        assert len(calls) == expected, (layer, len(calls))


def test_images_are_checked_before_the_model_runs() -> None:
    model = HeadedModel(build_tiny("vit", 2), [HeadConfig("h", pred_for_sequence=True)])
    pixels = _images(2)
    with pytest.raises(
        BatchError, match=r"unexpected batch key\(s\) \['pixel_value'\].*pixel_values"
    ):
        model(pixel_value=pixels)
    with pytest.raises(
        BatchError, match=r"pixel_values of \(16, 16\) pixels; ViTModel takes 32x32"
    ):
        model(pixel_values=pixels[:, :, :16, :16])
    with pytest.raises(BatchError, match=r"pixel_values must be a floating-point"):
        model(pixel_values=(pixels * 100).long())
    with pytest.raises(
        BatchError, match=r"has 1 at dim 1, but the model's config has num_channels=3"
    ):
        model(pixel_values=pixels[:, :1])
    with pytest.raises(BatchError, match=r"ViTModel takes pixel_values, not input_ids"):
        model(input_ids=torch.tensor([[1, 2]]), pixel_values=pixels)
    with pytest.raises(BatchError, match=r"the batch needs pixel_values"):
        model()
    interpolated = model(pixel_values=pixels[:, :, :16, :16], interpolate_pos_encoding=True)
    assert interpolated.logits.shape == (2, 1)


def test_a_vit_probe_saves_by_reference_and_reloads_exactly(tmp_path) -> None:
    build_tiny("vit", LAYERS).save_pretrained(tmp_path / "vit")
    image_processor().save_pretrained(tmp_path / "vit")
    heads = [HeadConfig("colour", num_outputs=2, pred_for_sequence=True, layer_hook=2)]
    model = load_headed(str(tmp_path / "vit"), head_configs=heads)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.normal_()
    pixels = _images(2)
    expected = model(pixel_values=pixels).logits
    model.save_pretrained(tmp_path / "probe")
    manifest = json.loads((tmp_path / "probe" / "head_configs.json").read_text())
    assert manifest["backbone"]["kind"] == "reference"
    assert not list((tmp_path / "probe").glob("backbone-*"))
    reloaded = HeadedModel.from_pretrained(tmp_path / "probe")
    assert type(reloaded.backbone).__name__ == "ViTModel"
    assert torch.equal(reloaded(pixel_values=pixels).logits, expected)


def test_trainer_learns_a_head_from_processed_images(tmp_path) -> None:
    images, labels = planted_images(16)
    processor = image_processor()
    data = [
        {"pixel_values": processor(images=im, return_tensors="pt")["pixel_values"][0], "colour": y}
        for im, y in zip(images, labels)
    ]
    model = HeadedModel(
        build_tiny("vit", 2), [HeadConfig("colour", num_outputs=2, pred_for_sequence=True)]
    )
    batch = HeadedCollator(model)(data[:4])
    assert batch["pixel_values"].shape == (4, 3, IMAGE_SIZE, IMAGE_SIZE)  # stacked
    assert batch["labels"].tolist() == labels[:4]
    before = model(pixel_values=batch["pixel_values"], labels=batch["labels"]).loss
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        learning_rate=0.1,
        num_train_epochs=8,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    HeadedTrainer(model=model, args=args, train_dataset=data).train()
    model.eval()
    after = model(pixel_values=batch["pixel_values"], labels=batch["labels"]).loss
    assert after < before


def test_compiles_as_one_graph_reading_transformers_capture_hooks() -> None:
    """Under torch.compile a head below the last layer reads ``hidden_states`` through the
    capture hooks HeadedModel installed beforehand (hooks cannot be added inside a graph)."""
    model = HeadedModel(build_tiny("vit", LAYERS), _every_layer()[4:8], check_inputs=False)
    assert_compiles_like_eager(model, {"pixel_values": _images(2)})


def test_last_hidden_state_reads_the_output_so_it_takes_no_other_layer() -> None:
    with pytest.raises(ConfigError, match=r"layer_hook=2 is invalid; last_hidden_state=True reads"):
        HeadConfig("h", layer_hook=2, last_hidden_state=True)
    # where hidden_states[-1] is the output already (BERT), it is the same state
    bert = HeadedModel(build_tiny("bert", 2), [HeadConfig("h", last_hidden_state=True)])
    assert bert.hooked_layers() == {"h": 2}


def test_image_examples_that_cannot_be_batched_are_refused() -> None:
    model = HeadedModel(
        build_tiny("vit", 2), [HeadConfig("c", num_outputs=2, pred_for_sequence=True)]
    )
    collate = HeadedCollator(model)
    small, big = torch.zeros(3, 16, 16), torch.zeros(3, 32, 32)
    with pytest.raises(
        BatchError, match=r"pixel_values of different shapes \[\(3, 16, 16\), \(3, 32, 32\)\]"
    ):
        collate([{"pixel_values": small, "c": 0}, {"pixel_values": big, "c": 1}])
    with pytest.raises(BatchError, match=r"feature 1 has no 'pixel_values', but feature 0 has"):
        collate([{"pixel_values": big, "c": 0}, {"c": 1}])
    with pytest.raises(
        BatchError,
        match=r"target 'c' is read per position, .* neither input_ids nor audio",
    ):
        tagger = HeadedModel(build_tiny("vit", 2), [HeadConfig("c", num_outputs=2)])
        HeadedCollator(tagger)([{"pixel_values": big, "c": [0, 1]}])
