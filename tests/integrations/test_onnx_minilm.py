"""ONNX export of heads on the packaged all-MiniLM-L6-v2, on real text through its tokenizer:
a sequence head and a token head on layer 3 (the graph keeps blocks 0-2 of 6), and the
tokenizer saved beside the graph."""

from __future__ import annotations

import pytest
import torch
from onnx_checks import check_cut, compare_with_eager
from transformers import AutoModel, AutoTokenizer

from headkit import HeadConfig, HeadedModel
from headkit.integrations.onnx import export_onnx
from headkit.packaged import minilm_path

pytestmark = pytest.mark.usefixtures("single_thread")

TEXTS = [
    "A warm, funny and surprisingly moving film.",
    "Dull.",
    "The plot never quite comes together, but the performances are worth the ticket.",
]


def test_minilm_heads_on_layer_3_on_real_text(tmp_path, minilm_tokenizer):
    torch.manual_seed(0)
    heads = [
        HeadConfig(
            "sentiment",
            num_outputs=2,
            pred_for_sequence=True,
            pooling="mean",
            layer_hook=3,
            extra={"classes": ["rotten", "fresh"]},
        ),
        HeadConfig("chunks", num_outputs=4, layer_hook=3),
    ]
    model = HeadedModel(AutoModel.from_pretrained(minilm_path()), heads).eval()
    result = export_onnx(model, tmp_path, tokenizer=minilm_tokenizer)
    assert result.blocks == 3
    check_cut(model, result.graph, 3)
    assert result.description["backbone"]["num_layers"] == 6
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)  # saved beside the graph
    for side in ("right", "left"):
        tokenizer.padding_side = side
        batch = dict(tokenizer(TEXTS, padding=True, return_tensors="pt"))
        diffs = compare_with_eager(model, result.graph, batch)
        assert max(diffs.values()) <= 1e-4, (side, diffs)
