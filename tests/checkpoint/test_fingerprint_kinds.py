"""A referenced backbone is checked by the fingerprint kinds this version writes (``files:``,
``tensors:``); a fingerprint of another kind is not compared, and the checkpoint loads."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import build_tiny

from headkit import HeadConfig, HeadedModel, load_headed
from headkit.checkpoint import MANIFEST

pytestmark = pytest.mark.usefixtures("single_thread")

IDS = torch.tensor([[5, 6, 7, 8]])


@pytest.mark.parametrize("fingerprint", ["sums:0123abcd", "0123abcd"])
def test_a_fingerprint_of_an_unknown_kind_is_not_compared(tmp_path, fingerprint):
    build_tiny("gpt2", num_layers=2).save_pretrained(tmp_path / "gpt2")
    model = load_headed(
        str(tmp_path / "gpt2"), head_configs=[HeadConfig("h", num_outputs=2)]
    ).eval()
    want = model(input_ids=IDS).preds_by_head["h"]
    model.save_pretrained(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / MANIFEST).read_text())
    assert manifest["backbone"]["kind"] == "reference"
    assert manifest["backbone"]["fingerprint"].startswith(("files:", "tensors:"))
    manifest["backbone"]["fingerprint"] = fingerprint
    (tmp_path / "ckpt" / MANIFEST).write_text(json.dumps(manifest))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither a warning nor an error
        again = HeadedModel.from_pretrained(tmp_path / "ckpt").eval()
    assert torch.equal(again(input_ids=IDS).preds_by_head["h"], want)
