"""References stay inside their root, and no weights are read from a pickle: a checkpoint
reference may not leave the folder that holds the checkpoint, a package reference may not
leave its package, the recorded ``subfolder`` / ``gguf_file`` may not leave the backbone's
folder, and a referenced folder of pickle weights is refused before anything reads them.
A missing model folder is named as a missing folder, not as a bad hub repo id.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import build_tiny

from headkit import CheckpointError, HeadConfig, HeadedModel, load_headed
from headkit.backbone.sources import load_model, source_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")

MANIFEST = "head_configs.json"
HEADS = [HeadConfig("cls", num_outputs=3, pred_for_sequence=True, pooling="mean")]
IDS = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])


def predict(model: HeadedModel) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).preds_by_head["cls"]


def edit_backbone(folder: Path, **changes: object) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["backbone"].update(changes)
    (folder / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    """``outside/gpt2`` (a model out of the checkpoint's reach) and ``runs/ckpt`` saved on
    ``runs/gpt2`` beside it (recorded as ``{"checkpoint": "../gpt2"}``)."""
    torch.manual_seed(0)
    model = build_tiny("gpt2", num_layers=2)
    for where in ("outside/gpt2", "runs/gpt2"):
        model.save_pretrained(tmp_path / where)
    headed = load_headed(str(tmp_path / "runs/gpt2"), head_configs=HEADS)
    headed.save_pretrained(tmp_path / "runs/ckpt")
    return {"ckpt": tmp_path / "runs/ckpt", "outside": tmp_path / "outside/gpt2"}


def test_the_untouched_reference_loads(layout):
    entry = json.loads((layout["ckpt"] / MANIFEST).read_text())["backbone"]
    assert entry["source"] == {"checkpoint": "../gpt2"}
    HeadedModel.from_pretrained(layout["ckpt"])


ESCAPES = {
    "checkpoint-up-and-over": lambda lay: {"checkpoint": "../../outside/gpt2"},
    "checkpoint-to-the-root": lambda lay: {"checkpoint": "../../../../../../../.."},
    "package-up-and-over": lambda lay: {
        "package": "torch",
        "path": os.path.relpath(lay["outside"], metadata.distribution("torch").locate_file("")),
    },
    "package-dot-dot": lambda lay: {"package": "torch", "path": "torch/../.."},
    "package-absolute": lambda lay: {"package": "torch", "path": str(lay["outside"])},
}


@pytest.mark.parametrize("source", ESCAPES.values(), ids=ESCAPES)
def test_a_reference_may_not_leave_its_root(layout, source):
    edit_backbone(layout["ckpt"], source=source(layout))
    with pytest.raises(CheckpointError, match=r"resolves to '.*', outside .* stays inside"):
        HeadedModel.from_pretrained(layout["ckpt"])


def test_a_checkpoint_reference_through_a_symlink_leading_out_is_refused(layout):
    (layout["ckpt"].parent / "gpt2").rename(layout["ckpt"].parent / "moved")
    (layout["ckpt"].parent / "gpt2").symlink_to(layout["outside"])
    with pytest.raises(CheckpointError, match=r"outside '.*runs'; a checkpoint reference"):
        HeadedModel.from_pretrained(layout["ckpt"])


@pytest.mark.parametrize(
    ("key", "value"),
    [("subfolder", "../../outside/gpt2"), ("gguf_file", "../x.gguf"), ("subfolder", "/etc")],
)
def test_recorded_keywords_may_not_leave_the_backbones_folder(layout, key, value):
    edit_backbone(layout["ckpt"], kwargs={key: value})
    with pytest.raises(CheckpointError, match=rf"backbone\.kwargs\.{key}='.*' is invalid"):
        HeadedModel.from_pretrained(layout["ckpt"])


# ---------------------------------------------------------------------- pickles
@pytest.fixture
def pickled(tmp_path: Path) -> Path:
    """A model folder whose weights are only a (benign) pickle: pytorch_model.bin."""
    folder = tmp_path / "pickled"
    torch.manual_seed(0)
    model = build_tiny("gpt2", num_layers=2)
    model.save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return folder


def test_a_referenced_folder_of_pickle_weights_is_refused_before_reading_them(tmp_path, pickled):
    """A plain state dict in pytorch_model.bin is what torch.load(weights_only=True) would
    read; a checkpoint never reads it."""
    ckpt = tmp_path / "ckpt"
    torch.manual_seed(0)
    model = build_tiny("gpt2", num_layers=2)
    model.save_pretrained(tmp_path / "base")
    load_headed(str(tmp_path / "base"), head_configs=HEADS).save_pretrained(ckpt)
    for source in (str(pickled), {"checkpoint": "../pickled"}):
        edit_backbone(ckpt, source=source)
        with pytest.raises(
            CheckpointError, match=r"holds no safetensors weights, only pickle files "
        ):
            HeadedModel.from_pretrained(ckpt)


def test_a_config_naming_a_pickle_weights_file_is_refused(tmp_path, pickled):
    shutil.copy(pickled / "pytorch_model.bin", pickled / "adapter_model.bin")
    config = json.loads((pickled / "config.json").read_text())
    (pickled / "config.json").write_text(
        json.dumps({**config, "transformers_weights": "adapter_model.bin"})
    )
    torch.manual_seed(0)
    build_tiny("gpt2", num_layers=2).save_pretrained(tmp_path / "base")
    (pickled / "model.safetensors").write_bytes((tmp_path / "base/model.safetensors").read_bytes())
    ckpt = tmp_path / "ckpt"
    load_headed(str(tmp_path / "base"), head_configs=HEADS).save_pretrained(ckpt)
    edit_backbone(ckpt, source=str(pickled))
    with pytest.raises(CheckpointError, match=r"only pickle files \['adapter_model\.bin'\]"):
        HeadedModel.from_pretrained(ckpt)


def test_a_model_loaded_from_pickle_weights_is_saved_as_safetensors(tmp_path, pickled):
    """Loading a pickle you trust yourself stays possible; its checkpoint copies the backbone,
    so the checkpoint never needs the pickle."""
    model = load_headed(str(pickled), head_configs=HEADS)
    model.save_pretrained(tmp_path / "ckpt")
    entry = json.loads((tmp_path / "ckpt" / MANIFEST).read_text())["backbone"]
    assert entry["kind"] == "saved"
    assert torch.equal(predict(HeadedModel.from_pretrained(tmp_path / "ckpt")), predict(model))
    with pytest.raises(CheckpointError, match=r"save_backbone=False, but .* never loads pickles"):
        model.save_pretrained(tmp_path / "ref", save_backbone=False)


# ---------------------------------------------------------------------- missing folders
@pytest.mark.parametrize("name", ["./models/missing", "../missing-model", "/abs/missing/model"])
def test_a_missing_model_folder_is_named_as_a_missing_folder(name):
    for load in (
        lambda: load_headed(name, head_configs=HEADS),
        lambda: load_model(name),
        lambda: source_tokenizer(name),
    ):
        with pytest.raises(CheckpointError, match=r"model folder '.*' does not exist") as info:
            load()
        assert "repo id" not in str(info.value) and "no such folder" in str(info.value)
