"""ONNX export of heads on the packaged all-MiniLM-L6-v2 (a BERT), on real text through its
tokenizer and on token ids with segments: a sequence head and a token head on layer 3 (the
graph keeps blocks 0-2 of 6), the backbone's own pooler on a middle layer (the cut keeps the
pooler, not the later blocks), an MLP token head on layer 1, ``token_type_ids`` as an input,
and the tokenizer saved beside the graph."""

from __future__ import annotations

import pytest
import torch
import yaml
from onnx_checks import check_cut, compare_with_eager, padded
from transformers import AutoModel, AutoTokenizer

from headkit import HeadConfig, HeadedModel
from headkit.integrations.onnx import export_onnx
from headkit.packaged import minilm_path

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

TEXTS = [
    "A warm, funny and surprisingly moving film.",
    "Dull.",
    "The plot never quite comes together, but the performances are worth the ticket.",
]
HEADS = [
    HeadConfig(
        "sentiment",
        num_outputs=2,
        pred_for_sequence=True,
        pooling="mean",
        layer_hook=3,
        extra={"classes": ["rotten", "fresh"]},
    ),
    HeadConfig("chunks", num_outputs=4, layer_hook=3),
    HeadConfig("nli", num_outputs=3, pred_for_sequence=True, pooling="pooler", layer_hook=2),
    HeadConfig(
        "ner", num_outputs=7, layer_hook=1, num_layers=2, hidden_size=16, hidden_activation="gelu"
    ),
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, minilm_tokenizer):
    torch.manual_seed(0)
    model = HeadedModel(AutoModel.from_pretrained(minilm_path()), HEADS).eval()
    folder = tmp_path_factory.mktemp("onnx")
    return model, export_onnx(model, folder, tokenizer=minilm_tokenizer), folder


def test_the_graph_keeps_blocks_0_to_2_and_takes_token_types(exported):
    model, result, _ = exported
    assert [i["name"] for i in result.description["inputs"]] == [
        "input_ids",
        "attention_mask",
        "token_type_ids",
    ]
    assert result.blocks == 3
    check_cut(model, result.graph, 3)
    assert result.description["backbone"]["num_layers"] == 6
    assert max(result.max_abs_diff.values()) <= 1e-4


def test_the_export_has_a_card_naming_its_heads_and_how_to_run_it(exported):
    _, _, folder = exported
    card = (folder / "README.md").read_text()
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["library_name"] == "onnx" and meta["pipeline_tag"] == "text-classification"
    assert meta["tags"] == ["headkit", "onnx", "text-classification", "token-classification"]
    assert "ort.InferenceSession(" in card and "sentiment, chunks, nli, ner" in card


def test_real_text_through_the_saved_tokenizer_padded_on_either_side(exported):
    model, result, folder = exported
    tokenizer = AutoTokenizer.from_pretrained(folder)  # saved beside the graph
    for side in ("right", "left"):
        tokenizer.padding_side = side
        batch = dict(tokenizer(TEXTS, padding=True, return_tensors="pt"))
        diffs = compare_with_eager(model, result.graph, batch)
        assert max(diffs.values()) <= 1e-4, (side, diffs)


def test_token_ids_with_two_segments_padded_on_either_side(exported):
    model, result, _ = exported
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1000, 20000, (4, 29), generator=g)
    for side in ("right", "left"):
        batch = padded(ids, [29, 15, 7, 28], side)
        batch["token_type_ids"] = (torch.arange(29) >= 10).long().expand(4, 29).clone()
        diffs = compare_with_eager(model, result.graph, batch)
        assert max(diffs.values()) <= 1e-4, (side, diffs)
