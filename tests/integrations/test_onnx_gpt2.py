"""ONNX export of a GPT-2 with a sequence head and a token head below the last layer: one
graph, the backbone cut after the deepest hooked block, verified against eager."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny
from onnx_checks import blocks_in_graph, check_cut, compare_with_eager, padded

import headkit
from headkit import ConfigError, HeadConfig, HeadedModel
from headkit.integrations.onnx import SIDECAR, export_onnx

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

HEADS = [
    HeadConfig(
        "sentiment",
        num_outputs=3,
        pred_for_sequence=True,
        pooling="mean",
        layer_hook=2,
        output_activation="softmax",
        extra={"classes": ["neg", "neu", "pos"]},
    ),
    HeadConfig("tags", num_outputs=5, layer_hook=1),
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = HeadedModel(build_tiny("gpt2", num_layers=4), HEADS).eval()
    folder = tmp_path_factory.mktemp("onnx")
    with torch.no_grad():  # an earlier export, then a file of the user's beside it
        headkit.export(model, folder, format="onnx", exporter="torchscript")
        (folder / "notes.txt").write_text("mine")
        result = headkit.export(model, folder, format="onnx", overwrite=True)
    return model, result


def test_the_graph_holds_only_the_blocks_the_heads_need(exported):
    model, result = exported
    assert result.exporter == "dynamo"
    assert result.blocks == 2  # hidden state 2 = the output of block 2 (of 4)
    assert blocks_in_graph(result.graph, model.info.layers_path) == {0, 1}
    check_cut(model, result.graph, 2)
    assert result.description["backbone"] == {
        "class": "GPT2Model",
        "name_or_path": "",
        "num_layers": 4,
        "blocks_in_graph": 2,
        "max_length": 64,
    }


def test_onnxruntime_matches_eager_on_new_shapes_padded_on_either_side(exported):
    model, result = exported
    assert set(result.max_abs_diff) == {"sentiment", "tags"}
    assert max(result.max_abs_diff.values()) <= 1e-4
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 100, (5, 41), generator=g)
    for side in ("right", "left"):
        batch = padded(ids, [41, 30, 12, 1, 40], side)
        diffs = compare_with_eager(model, result.graph, batch)
        assert max(diffs.values()) <= 1e-4, (side, diffs)
    one = compare_with_eager(model, result.graph, padded(ids[:1, :3], [3], "right"))
    assert max(one.values()) <= 1e-4


def test_the_json_says_how_to_read_each_output(exported):
    _, result = exported
    described = json.loads((result.directory / SIDECAR).read_text())
    assert described == result.description | {"files": described["files"]}
    assert [i["name"] for i in described["inputs"]] == ["input_ids", "attention_mask"]
    sentiment, tags = described["outputs"]
    assert sentiment["name"] == "sentiment" and sentiment["shape"] == ["batch", 3]
    assert sentiment["head"]["classes"] == ["neg", "neu", "pos"]
    assert sentiment["head"]["output_activation"] == "softmax"
    assert sentiment["head"]["pooling"] == "mean" and sentiment["head"]["layer"] == 2
    assert tags["shape"] == ["batch", "sequence", 5] and tags["head"]["layout"] == "token"
    assert described["verified"]["max_abs_diff"] == result.max_abs_diff
    assert (result.directory / "notes.txt").read_text() == "mine"  # the user's file stays
    assert not list(result.directory.glob(".tmp-*"))


def test_the_torchscript_exporter_when_asked_and_a_subset_of_heads(exported, tmp_path):
    model, _ = exported
    result = export_onnx(model, tmp_path, heads=["tags"], exporter="torchscript")
    assert result.exporter == "torchscript" and result.description["exporter"] == "torchscript"
    assert result.blocks == 1 and list(result.max_abs_diff) == ["tags"]
    batch = padded(torch.randint(3, 100, (2, 17)), [17, 9], "left")
    assert compare_with_eager(model, result.graph, batch)["tags"] <= 1e-4


def test_what_cannot_be_exported_is_refused(exported, tmp_path):
    model, _ = exported
    with pytest.raises(ConfigError, match=r"heads=\['nope'\] names \['nope'\]; the model's heads"):
        export_onnx(model, tmp_path, heads=["nope"])
    with pytest.raises(ConfigError, match=r"exporter='jit' is invalid; allowed: auto, dynamo"):
        export_onnx(model, tmp_path, exporter="jit")
    with pytest.raises(ConfigError, match=r"format='tflite' is invalid; allowed: onnx, trans"):
        headkit.export(model, tmp_path, format="tflite")
    half = HeadedModel(build_tiny("gpt2", num_layers=1).half(), [HeadConfig("t", num_outputs=2)])
    with pytest.raises(ConfigError, match=r"needs a float32 model, got torch.float16"):
        export_onnx(half, tmp_path)
    with pytest.raises(ConfigError, match=r"token_type_ids=True, but GPT2Model has no token-type"):
        export_onnx(model, tmp_path, token_type_ids=True)
    assert not list(tmp_path.iterdir())  # nothing written
