"""``headkit export`` and ``headkit push`` on a checkpoint folder, in process."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny
from onnx_checks import compare_with_eager, padded
from tiny_text import tiny_tokenizer
from transformers import AutoModelForTokenClassification, AutoTokenizer

from headkit import HeadConfig, HeadedModel
from headkit.checkpoint.manifest import MANIFEST
from headkit.cli.main import main

pytestmark = pytest.mark.usefixtures("single_thread")

HEADS = [
    HeadConfig("tags", num_outputs=3, extra={"classes": ["O", "B", "I"]}),
    HeadConfig("mood", num_outputs=2, pred_for_sequence=True, pooling="mean", layer_hook=1),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    model = HeadedModel(build_tiny("bert", num_layers=2), HEADS).eval()
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder, model


def test_export_transformers_writes_a_token_classifier_with_the_tokenizer(
    checkpoint, tmp_path, capsys
):
    folder, model = checkpoint
    out = tmp_path / "hf"
    args = [str(folder), "--format", "transformers", "--head", "tags", "--output", str(out)]
    assert main(["export", *args, "--quiet"]) == 0
    assert "BertForTokenClassification, loads with AutoModelForTokenClassification" in (
        capsys.readouterr().out
    )
    loaded = AutoModelForTokenClassification.from_pretrained(out, trust_remote_code=False)
    assert loaded.config.id2label == {0: "O", 1: "B", 2: "I"}
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.padding_side == "right"
    batch = tok(["good w1 w2", "w3"], padding=True, return_tensors="pt")
    with torch.no_grad():
        want = model(**batch).preds_by_head["tags"]
        got = loaded(**batch).logits
    keep = batch["attention_mask"].bool()
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)


def test_export_onnx_of_every_head(checkpoint, tmp_path, capsys):
    folder, model = checkpoint
    out = tmp_path / "onnx"
    # (the dynamo exporter is tested on every architecture in test_onnx_*.py; it takes ~8 s)
    args = ["export", str(folder), "--output", str(out), "--exporter", "torchscript"]
    assert main([*args, "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "torchscript exporter, 2 of 2 blocks" in printed and "tags" in printed
    described = json.loads((out / "headkit_onnx.json").read_text())
    assert [o["name"] for o in described["outputs"]] == ["tags", "mood"]
    assert (out / "tokenizer.json").is_file()
    batch = padded(torch.randint(4, 48, (2, 9)), [9, 4], "left")
    batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    assert max(compare_with_eager(model, out / "model.onnx", batch).values()) <= 1e-4


def test_export_errors_are_one_line(checkpoint, tmp_path, capsys):
    folder, _ = checkpoint
    args = [str(folder), "--format", "transformers", "--output", str(tmp_path), "--quiet"]
    code = main(["export", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "has 2 heads (tags, mood)" in err and "pass head=NAME" in err


def test_push_dry_run_writes_the_staged_folder(checkpoint, tmp_path, capsys):
    folder, model = checkpoint
    out = tmp_path / "staged"
    assert main(["push", str(folder), "me/tagger", "--dry-run", "--output", str(out)]) == 0
    assert f"for me/tagger in {out}" in capsys.readouterr().out
    assert (out / MANIFEST).is_file() and (out / "tokenizer.json").is_file()
    loaded = HeadedModel.from_pretrained(out)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=ids).preds_by_head["tags"], model(input_ids=ids).preds_by_head["tags"]
        )
    code = main(["push", str(folder), "me/tagger", "--output", str(tmp_path / "x")])
    assert code == 2 and "add --dry-run" in capsys.readouterr().err
