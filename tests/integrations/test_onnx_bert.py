"""ONNX export of a BERT: token_type_ids as an input, the backbone's own pooler on a middle
layer (the cut keeps the pooler, not the later blocks), a token head beside it."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny
from onnx_checks import check_cut, compare_with_eager, padded

from headkit import HeadConfig, HeadedModel
from headkit.integrations.onnx import export_onnx

pytestmark = pytest.mark.usefixtures("single_thread")


def test_bert_pooler_head_on_a_middle_layer_and_a_token_head(tmp_path):
    heads = [
        HeadConfig("nli", num_outputs=3, pred_for_sequence=True, pooling="pooler", layer_hook=2),
        HeadConfig(
            "ner",
            num_outputs=7,
            layer_hook=1,
            num_layers=2,
            hidden_size=16,
            hidden_activation="gelu",
        ),
    ]
    model = HeadedModel(build_tiny("bert", num_layers=4), heads).eval()
    result = export_onnx(model, tmp_path)
    assert [i["name"] for i in result.description["inputs"]] == [
        "input_ids",
        "attention_mask",
        "token_type_ids",
    ]
    assert result.blocks == 2
    check_cut(model, result.graph, 2)
    assert max(result.max_abs_diff.values()) <= 1e-4
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(4, 100, (4, 29), generator=g)
    for side in ("right", "left"):
        batch = padded(ids, [29, 15, 7, 28], side)
        batch["token_type_ids"] = (torch.arange(29) >= 10).long().expand(4, 29).clone()
        diffs = compare_with_eager(model, result.graph, batch)
        assert max(diffs.values()) <= 1e-4, (side, diffs)
