"""ONNX export of a Llama with several heads on the last layer (no cut: the whole backbone,
final norm included): sequence and token heads, verified against eager on both paddings."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny
from onnx_checks import check_cut, compare_with_eager, padded

from headkit import HeadConfig, HeadedModel
from headkit.integrations.onnx import export_onnx

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]


def test_llama_heads_on_the_last_layer(tmp_path):
    heads = [
        HeadConfig("topic", num_outputs=4, pred_for_sequence=True),  # "last" for decoders
        HeadConfig(
            "score",
            num_outputs=1,
            pred_for_sequence=True,
            pooling="weighted_mean",
            is_regression=True,
            loss_fct="mse",
            output_activation="sigmoid",
        ),
        HeadConfig("tags", num_outputs=3),
    ]
    model = HeadedModel(build_tiny("llama", num_layers=2), heads).eval()
    result = export_onnx(model, tmp_path)
    assert result.exporter == "dynamo" and result.blocks == 2
    assert max(result.max_abs_diff.values()) <= 1e-4
    check_cut(model, result.graph, 2)
    outputs = {o["name"]: o["shape"] for o in result.description["outputs"]}
    assert outputs == {
        "topic": ["batch", 4],
        "score": ["batch", 1],
        "tags": ["batch", "sequence", 3],
    }
    ids = torch.randint(3, 100, (3, 33), generator=torch.Generator().manual_seed(3))
    for side in ("left", "right"):
        diffs = compare_with_eager(model, result.graph, padded(ids, [33, 20, 2], side))
        assert max(diffs.values()) <= 1e-4, (side, diffs)
