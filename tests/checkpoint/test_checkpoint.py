"""Checkpoints: save → load round trips, referenced vs saved backbones, atomicity, no pickle."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from conftest import build_tiny

import headkit.checkpoint
from headkit import HeadConfig, HeadedModel, load_headed
from headkit.checkpoint import load_head_weights

pytestmark = pytest.mark.usefixtures("single_thread")

#: One head of every kind: causal LM, token classification, token regression MLP, and
#: sequence heads with parameter-free and learned pooling.
GPT2_HEADS = [
    HeadConfig("lm_head", is_causal_lm=True),
    HeadConfig("tag", layer_hook=1, num_outputs=5),
    HeadConfig(
        "depth",
        layer_hook=-2,
        num_layers=3,
        hidden_size=16,
        hidden_activation="gelu",
        is_regression=True,
        loss_fct="mse",
        output_bias=True,
    ),
    HeadConfig("topic", num_outputs=3, pred_for_sequence=True, pooling="mean+max"),
    HeadConfig(
        "toxic",
        layer_hook=2,
        pred_for_sequence=True,
        pooling="attention",
        output_activation="sigmoid",
        loss_fct="bce",
    ),
]
BERT_HEADS = [
    HeadConfig("cls", num_outputs=2, pred_for_sequence=True, pooling="pooler"),
    HeadConfig("ner", layer_hook=-3, num_outputs=4, num_layers=2, hidden_size=8),
]

BATCH = {
    "input_ids": torch.tensor([[5, 6, 7, 8, 2, 2], [9, 10, 11, 12, 13, 14]]),
    "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]),
}


def predict(model: HeadedModel) -> dict[str, torch.Tensor]:
    model.eval()
    with torch.no_grad():
        return model(**BATCH).preds_by_head


def assert_same_predictions(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)


def perturb_heads(model: HeadedModel, seed: int = 0) -> None:
    """Move every head weight away from its initial value, as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))


def total_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def weight_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("heads-*.safetensors"))


@pytest.fixture
def gpt2_dir(tmp_path: Path) -> Path:
    """A tiny GPT2LMHeadModel saved as a normal Hugging Face folder (safetensors)."""
    path = tmp_path / "gpt2"
    build_tiny("gpt2").save_pretrained(path)
    return path


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize(("arch", "configs"), [("gpt2", GPT2_HEADS), ("bert", BERT_HEADS)])
def test_in_memory_model_round_trips_with_its_backbone(tmp_path, arch, configs):
    model = HeadedModel(build_tiny(arch), configs)
    perturb_heads(model)
    expected = predict(model)
    model.save_pretrained(tmp_path / "ckpt")

    manifest = json.loads((tmp_path / "ckpt" / "head_configs.json").read_text())
    assert manifest["backbone"]["kind"] == "saved"  # built in memory: nothing to reference
    assert (tmp_path / "ckpt" / manifest["backbone"]["path"] / "config.json").is_file()
    assert_same_predictions(predict(HeadedModel.from_pretrained(tmp_path / "ckpt")), expected)


def test_manifest_holds_format_version_and_head_configs(tmp_path):
    model = HeadedModel(build_tiny("gpt2"), GPT2_HEADS)
    model.save_pretrained(tmp_path)
    manifest = json.loads((tmp_path / "head_configs.json").read_text())
    assert manifest["format_version"] == 1
    assert manifest["heads"] == [c.to_dict() for c in model.head_configs.values()]
    assert [HeadConfig.from_dict(h) for h in manifest["heads"]] == list(model.head_configs.values())
    assert manifest["weights"] == weight_files(tmp_path)[0]


def test_frozen_unchanged_backbone_is_referenced_not_copied(tmp_path, gpt2_dir):
    model = load_headed(str(gpt2_dir), head_configs=GPT2_HEADS)
    perturb_heads(model)
    expected = predict(model)
    model.save_pretrained(tmp_path / "heads_only")

    manifest = json.loads((tmp_path / "heads_only" / "head_configs.json").read_text())
    assert manifest["backbone"]["kind"] == "reference"
    # recorded beside the checkpoint, relative to it, so the pair can move
    assert manifest["backbone"]["source"] == {"checkpoint": "../gpt2"}
    assert not list((tmp_path / "heads_only").glob("backbone-*"))

    # the same model with its backbone copied is several times larger
    model.save_pretrained(tmp_path / "with_backbone", save_backbone=True)
    small, full = total_bytes(tmp_path / "heads_only"), total_bytes(tmp_path / "with_backbone")
    assert small * 3 < full, (small, full)

    for loaded in (
        load_headed(str(gpt2_dir), head_folder_path=tmp_path / "heads_only"),
        HeadedModel.from_pretrained(tmp_path / "heads_only"),
        HeadedModel.from_pretrained(tmp_path / "with_backbone"),
    ):
        assert_same_predictions(predict(loaded), expected)


def test_a_trained_backbone_is_saved(tmp_path, gpt2_dir):
    model = load_headed(str(gpt2_dir), head_configs=GPT2_HEADS[1:2], freeze_base_model=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(**BATCH, tag=BATCH["input_ids"] % 5).loss.backward()
    optimizer.step()
    expected = predict(model)
    model.save_pretrained(tmp_path / "ckpt")

    manifest = json.loads((tmp_path / "ckpt" / "head_configs.json").read_text())
    assert manifest["backbone"]["kind"] == "saved"
    loaded = HeadedModel.from_pretrained(tmp_path / "ckpt")
    assert_same_predictions(predict(loaded), expected)
    # load_headed(path, head_folder_path=) restores the saved backbone too (one restore path,
    # never ignored) ...
    again = load_headed(str(gpt2_dir), head_folder_path=tmp_path / "ckpt")
    assert_same_predictions(predict(again), expected)
    # ... and the trained backbone differs from the original one: the saved copy matters
    original = load_headed(str(gpt2_dir), head_configs=list(again.head_configs.values()))
    load_head_weights(original, again.head_state_dict(), "test")
    assert not torch.allclose(predict(original)["tag"], expected["tag"])


def test_a_frozen_backbone_changed_in_place_is_saved(tmp_path, gpt2_dir):
    model = load_headed(str(gpt2_dir), head_configs=GPT2_HEADS[1:2])
    with torch.no_grad():
        model.backbone.wte.weight.mul_(1.5)
    expected = predict(model)
    model.save_pretrained(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / "head_configs.json").read_text())
    assert manifest["backbone"]["kind"] == "saved"
    assert_same_predictions(predict(HeadedModel.from_pretrained(tmp_path / "ckpt")), expected)


# ---------------------------------------------------------------------- atomic writes
def test_saving_twice_keeps_one_set_of_files(tmp_path):
    model = HeadedModel(build_tiny("gpt2"), GPT2_HEADS[1:3])
    model.save_pretrained(tmp_path)
    perturb_heads(model)
    expected = predict(model)
    model.save_pretrained(tmp_path)
    assert len(weight_files(tmp_path)) == 1
    assert len(list(tmp_path.glob("backbone-*"))) == 1
    assert not list(tmp_path.glob(".tmp-*"))
    assert_same_predictions(predict(HeadedModel.from_pretrained(tmp_path)), expected)


def test_an_interrupted_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch, gpt2_dir):
    model = load_headed(str(gpt2_dir), head_configs=GPT2_HEADS)
    perturb_heads(model, seed=1)
    first = predict(model)
    model.save_pretrained(tmp_path)

    perturb_heads(model, seed=2)
    assert not torch.allclose(predict(model)["tag"], first["tag"])
    real_replace = headkit.checkpoint.os.replace

    def crash_at_commit(src, dst):
        if Path(dst).name == "head_configs.json":
            raise OSError("simulated crash while committing the manifest")
        return real_replace(src, dst)

    monkeypatch.setattr(headkit.checkpoint.os, "replace", crash_at_commit)
    with pytest.raises(OSError, match="simulated crash"):
        model.save_pretrained(tmp_path)
    monkeypatch.undo()

    assert_same_predictions(predict(HeadedModel.from_pretrained(tmp_path)), first)
    assert_same_predictions(predict(load_headed(str(gpt2_dir), head_folder_path=tmp_path)), first)
    # the next successful save commits the new heads and clears the leftovers
    second = predict(model)
    model.save_pretrained(tmp_path)
    assert len(weight_files(tmp_path)) == 1 and not list(tmp_path.glob(".tmp-*"))
    assert_same_predictions(predict(HeadedModel.from_pretrained(tmp_path)), second)


# ---------------------------------------------------------------------- no pickle
class _WritesAFile:
    """Unpickling this creates ``marker``: proof that a pickle was read."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_stray_pickle_files_are_never_read(tmp_path):
    model = HeadedModel(build_tiny("gpt2"), GPT2_HEADS)
    perturb_heads(model)
    expected = predict(model)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    marker = tmp_path / "pickle_was_loaded"
    payload = pickle.dumps({"heads.tag.mlp.0.weight": _WritesAFile(marker)})
    (ckpt / "pytorch_model.bin").write_bytes(payload)
    (ckpt / "heads.pt").write_bytes(payload)
    backbone_dir = next(ckpt.glob("backbone-*"))
    (backbone_dir / "pytorch_model.bin").write_bytes(payload)

    loaded = HeadedModel.from_pretrained(ckpt)
    assert not marker.exists()
    assert_same_predictions(predict(loaded), expected)
