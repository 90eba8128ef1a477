"""A backbone ``from_pretrained`` loaded and left unchanged is referenced by a save however
the HeadedModel was built (``HeadedModel(ViTModel.from_pretrained(d), heads)`` as much as
``load_headed(d, ...)``), and the card says truly why a backbone was copied."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import IMAGE_SIZE, build_tiny
from transformers import AutoModel, GPT2LMHeadModel, ViTModel

from headkit import HeadConfig, HeadedModel
from headkit.checkpoint.card import BACKBONE_REASONS, CARD
from headkit.checkpoint.manifest import MANIFEST

pytestmark = pytest.mark.usefixtures("single_thread")
HEAD = HeadConfig("c", num_outputs=2, pred_for_sequence=True)


def _inputs(arch: str) -> dict:
    if arch == "vit":
        return {"pixel_values": torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=_g())}
    return {"input_ids": torch.randint(3, 90, (2, 6), generator=_g())}


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _backbone_entry(folder) -> dict:
    return json.loads((folder / MANIFEST).read_text())["backbone"]


@pytest.mark.parametrize(
    "arch, cls", [("vit", ViTModel), ("gpt2", GPT2LMHeadModel), ("bert", AutoModel)]
)
def test_a_loaded_unchanged_backbone_is_referenced_not_copied(tmp_path, arch, cls):
    build_tiny(arch, num_layers=2).save_pretrained(tmp_path / "base")
    model = HeadedModel(cls.from_pretrained(tmp_path / "base"), [HEAD])
    model.save_pretrained(tmp_path / "out")
    assert not list((tmp_path / "out").glob("backbone-*"))
    entry = _backbone_entry(tmp_path / "out")
    assert entry["kind"] == "reference" and entry["source"]["checkpoint"] == "../base"
    assert "Referenced, not copied" in (tmp_path / "out" / CARD).read_text()
    again = HeadedModel.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        assert torch.equal(model.eval()(**_inputs(arch)).logits, again(**_inputs(arch)).logits)


def test_a_backbone_changed_before_or_after_wrapping_is_copied_with_the_true_reason(tmp_path):
    build_tiny("vit", num_layers=2).save_pretrained(tmp_path / "base")
    loaded = ViTModel.from_pretrained(tmp_path / "base")
    with torch.no_grad():  # one element of one small tensor, before the heads are attached
        loaded.layers[0].layernorm_before.weight[3] += 1.0
    HeadedModel(loaded, [HEAD]).save_pretrained(tmp_path / "before")
    entry = _backbone_entry(tmp_path / "before")
    assert entry["kind"] == "saved" and entry["reason"] == "in_memory"
    card = (tmp_path / "before" / CARD).read_text()
    assert BACKBONE_REASONS["in_memory"] in card and "it was trained" not in card

    model = HeadedModel(ViTModel.from_pretrained(tmp_path / "base"), [HEAD])
    with torch.no_grad():
        model.backbone.embeddings.cls_token.mul_(2.0)  # after: the load stamp sees it
    model.save_pretrained(tmp_path / "after")
    assert _backbone_entry(tmp_path / "after")["reason"] == "changed"
    assert BACKBONE_REASONS["changed"] in (tmp_path / "after" / CARD).read_text()

    trained = HeadedModel(
        ViTModel.from_pretrained(tmp_path / "base"), [HEAD], freeze_base_model=False
    )
    trained.save_pretrained(tmp_path / "trainable")
    assert _backbone_entry(tmp_path / "trainable")["reason"] == "trainable"


def test_a_model_built_in_memory_is_still_copied(tmp_path):
    HeadedModel(build_tiny("bert", num_layers=2), [HEAD]).save_pretrained(tmp_path)
    assert _backbone_entry(tmp_path)["kind"] == "saved"
    assert _backbone_entry(tmp_path)["reason"] == "in_memory"
