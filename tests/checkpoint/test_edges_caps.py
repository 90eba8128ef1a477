"""Size caps checked before anything is built: heads per manifest and the manifest's bytes.
(LoRA ranks: ``tests/integrations/test_lora.py``; generate: ``tests/model/test_generation.py``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny

import headkit.checkpoint.manifest as manifest_module
from headkit import CheckpointError, HeadConfig, HeadedModel
from headkit.checkpoint.manifest import MAX_MANIFEST_BYTES

pytestmark = pytest.mark.usefixtures("single_thread")

MANIFEST = "head_configs.json"


def heads(n: int) -> list[HeadConfig]:
    return [HeadConfig(f"h{i}", num_outputs=2, pred_for_sequence=True) for i in range(n)]


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    HeadedModel(build_tiny("gpt2", num_layers=2), heads(3)).save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_a_manifest_of_100000_heads_is_refused_before_any_is_built(ckpt):
    manifest = json.loads((ckpt / MANIFEST).read_text())
    one = manifest["heads"][0]
    manifest["heads"] = [{**one, "name": f"head_{i:06d}"} for i in range(100_000)]
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    assert (ckpt / MANIFEST).stat().st_size > 5_000_000
    with pytest.raises(
        CheckpointError, match=r"describes 100000 heads; a checkpoint holds at most"
    ):
        HeadedModel.from_pretrained(ckpt)


def test_the_head_cap_counts_heads_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest_module, "MAX_HEADS", 3)
    model = HeadedModel(build_tiny("gpt2", num_layers=2), heads(3))
    model.save_pretrained(tmp_path / "three")
    HeadedModel.from_pretrained(tmp_path / "three")  # at the cap: loads
    HeadedModel(build_tiny("gpt2", num_layers=2), heads(4)).save_pretrained(tmp_path / "four")
    with pytest.raises(CheckpointError, match=r"describes 4 heads; a checkpoint holds at most 3"):
        HeadedModel.from_pretrained(tmp_path / "four")


def test_a_manifest_beyond_the_byte_cap_is_refused_unread(ckpt):
    text = (ckpt / MANIFEST).read_text()
    (ckpt / MANIFEST).write_text(text + " " * MAX_MANIFEST_BYTES)  # valid JSON, padded
    with pytest.raises(CheckpointError, match=r"is \d+ bytes; a manifest is at most 16777216"):
        HeadedModel.from_pretrained(ckpt)
