"""``headkit eval --record``: results go into the checkpoint's settings and model card."""

from __future__ import annotations

import json

import yaml
from cli_helpers import one_error_line, review_files, tiny_model, train_checkpoint

from headkit.cli.main import main


def _card_meta(ckpt):
    text = (ckpt / "README.md").read_text()
    return yaml.safe_load(text.split("---")[1]), text


def test_record_adds_a_result_per_data_set_and_replaces_the_same(tmp_path, capsys):
    files = review_files(tmp_path)
    ckpt = train_checkpoint(tmp_path, tiny_model(tmp_path), files["train"])
    weights = {p.name: p.read_bytes() for p in ckpt.glob("*.safetensors")}
    other = tmp_path / "other.csv"
    other.write_text(files["test"].read_text())
    for data in (files["test"], other, other):
        assert main(["eval", str(ckpt), "--data", str(data), "--record", "--quiet"]) == 0
    settings = json.loads((ckpt / "headkit_cli.json").read_text())
    assert [e["data"] for e in settings["evaluations"]] == [str(files["test"]), str(other)]
    meta, text = _card_meta(ckpt)
    names = [r["dataset"]["name"] for r in meta["model-index"][0]["results"]]
    assert names == [str(files["test"]), str(other)]
    assert f"On `{other}`" in text.replace("\\", "")
    assert {p.name: p.read_bytes() for p in ckpt.glob("*.safetensors")} == weights


def test_record_refuses_a_folder_that_is_not_a_headkit_checkpoint(tmp_path, capsys):
    files = review_files(tmp_path)
    folder = tmp_path / "plain"
    folder.mkdir()
    code = main(["eval", str(folder), "--data", str(files["test"]), "--record"])
    line = one_error_line(code, capsys.readouterr().err)
    assert "--record" in line and str(folder) in line


def test_record_refuses_a_read_only_checkpoint(tmp_path, capsys):
    files = review_files(tmp_path)
    ckpt = train_checkpoint(tmp_path, tiny_model(tmp_path), files["train"])
    ckpt.chmod(0o555)
    try:
        code = main(["eval", str(ckpt), "--data", str(files["test"]), "--record"])
    finally:
        ckpt.chmod(0o755)
    line = one_error_line(code, capsys.readouterr().err)
    assert "--record" in line and "read-only" in line


def test_record_refuses_a_card_written_by_hand_and_leaves_it(tmp_path, capsys):
    files = review_files(tmp_path)
    ckpt = train_checkpoint(tmp_path, tiny_model(tmp_path), files["train"])
    card = ckpt / "README.md"
    card.write_text("# My model\n\nWritten by hand.\n")
    settings = (ckpt / "headkit_cli.json").read_bytes()
    code = main(["eval", str(ckpt), "--data", str(files["test"]), "--record"])
    line = one_error_line(code, capsys.readouterr().err)
    assert "--record" in line and "not the card headkit wrote" in line
    assert card.read_text() == "# My model\n\nWritten by hand.\n"
    assert (ckpt / "headkit_cli.json").read_bytes() == settings


def test_record_on_the_training_eval_data_replaces_its_metrics(tmp_path, capsys):
    files = review_files(tmp_path)
    ckpt = train_checkpoint(tmp_path, tiny_model(tmp_path), files["train"])
    settings = json.loads((ckpt / "headkit_cli.json").read_text())
    eval_data = (settings.get("data") or {}).get("eval")
    if eval_data is None:  # the helper trains without data.eval: record on the train file
        eval_data = str(files["train"])
    assert main(["eval", str(ckpt), "--data", eval_data, "--record", "--quiet"]) == 0
    again = json.loads((ckpt / "headkit_cli.json").read_text())
    recorded = [e["data"] for e in again.get("evaluations", [])]
    assert recorded.count(eval_data) <= 1
    assert main(["eval", str(ckpt), "--data", eval_data, "--record", "--quiet"]) == 0
    twice = json.loads((ckpt / "headkit_cli.json").read_text())
    assert twice.get("evaluations", []) == again.get("evaluations", [])
