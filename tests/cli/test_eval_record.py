"""``headkit eval --record``: results go into the checkpoint's settings and model card."""

from __future__ import annotations

import json

import yaml
from cli_helpers import one_error_line, review_files, tiny_model, train_checkpoint
from tiny_text import planted_texts

from headkit.checkpoint.card import PACKAGED_DATASETS
from headkit.cli.datafiles import write_rows
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


def test_record_on_a_packaged_data_set_names_it_in_the_cards_datasets(tmp_path, capsys):
    """``--data packaged:rotten_tomatoes``: the card's ``datasets`` gets its hub id (the only
    packaged set with one: ``card.PACKAGED_DATASETS``), the model-index its result."""
    texts, labels, _ = planted_texts(40, seed=5)  # labels 0/1, as the packaged reviews'
    rows = [{"text": t, "label": y} for t, y in zip(texts, labels)]
    train = write_rows(tmp_path / "train.csv", rows)
    ckpt = train_checkpoint(tmp_path, tiny_model(tmp_path), train)
    meta, _ = _card_meta(ckpt)
    assert "datasets" not in meta  # trained on a local file: no hub data set yet
    data = "packaged:rotten_tomatoes"
    assert main(["eval", str(ckpt), "--data", data, "--limit", "16", "--record", "--quiet"]) == 0
    settings = json.loads((ckpt / "headkit_cli.json").read_text())
    assert [e["data"] for e in settings["evaluations"]] == [data]
    meta, _ = _card_meta(ckpt)
    assert meta["datasets"] == [PACKAGED_DATASETS[data]]
    names = [r["dataset"]["name"] for r in meta["model-index"][0]["results"]]
    assert data in names
