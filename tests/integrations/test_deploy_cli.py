"""``headkit export`` and ``headkit push`` on a checkpoint folder, in process."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny
from onnx_checks import compare_with_eager, padded
from saved_files import saved_files
from tiny_text import tiny_tokenizer
from transformers import AutoModelForTokenClassification, AutoTokenizer

from headkit import ConfigError, HeadConfig, HeadedModel
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


#: A device torch does not see here (cuda:7 unless this machine has more than 7 GPUs).
UNSEEN = f"cuda:{max(7, torch.cuda.device_count())}"


@pytest.mark.parametrize("fmt", ["transformers", "onnx"])
def test_export_on_the_cpu_device_writes_what_the_default_writes(checkpoint, tmp_path, fmt):
    folder, _ = checkpoint
    args = [str(folder), "--format", fmt, "--quiet"]
    args += ["--head", "tags"] if fmt == "transformers" else ["--exporter", "torchscript"]
    default, cpu = tmp_path / "default" / "out", tmp_path / "cpu" / "out"  # one card title
    assert main(["export", *args, "--output", str(default)]) == 0
    assert main(["export", *args, "--output", str(cpu), "--device", "cpu"]) == 0
    written = saved_files(cpu, skip=())
    weights = "model.safetensors" if fmt == "transformers" else "model.onnx"
    assert {weights, "tokenizer.json", "README.md"} <= set(written)
    assert written == saved_files(default, skip=())


@pytest.mark.parametrize(
    "command",
    [
        ["export", "{ckpt}", "--output", "{out}"],
        ["export", "{ckpt}", "--format", "transformers", "--head", "tags", "--output", "{out}"],
        ["push", "{ckpt}", "me/tagger", "--dry-run", "--output", "{out}"],
        ["push", "{ckpt}", "me/tagger", "--dry-run", "--include-backbone", "--output", "{out}"],
    ],
    ids=["export-onnx", "export-transformers", "push", "push-with-backbone"],
)
def test_a_device_torch_does_not_see_is_refused_before_anything_is_written(
    checkpoint, tmp_path, capsys, command
):
    folder, _ = checkpoint
    before = sorted(p.name for p in folder.iterdir())
    out = tmp_path / "out"
    args = [a.format(ckpt=folder, out=out) for a in command]
    code = main([*args, "--quiet", "--device", UNSEEN])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"--device={UNSEEN!r}: torch sees no such device here" in err
    assert list(tmp_path.iterdir()) == [] and sorted(p.name for p in folder.iterdir()) == before


def test_push_with_the_backbone_on_the_cpu_device_stages_what_the_default_stages(
    checkpoint, tmp_path
):
    folder, _ = checkpoint
    args = ["push", str(folder), "me/tagger", "--dry-run", "--include-backbone", "--quiet"]
    assert main([*args, "--output", str(tmp_path / "default")]) == 0
    assert main([*args, "--output", str(tmp_path / "cpu"), "--device", "cpu"]) == 0
    staged = saved_files(tmp_path / "cpu")
    assert any(n.startswith("backbone-TOKEN/") and n.endswith(".safetensors") for n in staged)
    assert staged == saved_files(tmp_path / "default")


def test_export_of_a_model_object_refuses_a_device_torch_does_not_see(checkpoint, tmp_path):
    import headkit

    _, model = checkpoint
    with pytest.raises(ConfigError, match=rf"device='{UNSEEN}': torch sees no such device"):
        headkit.export(model, tmp_path / "out", "transformers", head="tags", device=UNSEEN)
    assert list(tmp_path.iterdir()) == []
