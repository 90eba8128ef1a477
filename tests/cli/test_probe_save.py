"""``headkit probe --save DIR`` writes the best probe as a checkpoint that ``headkit predict``
reads, predicting exactly what the probe predicted on the test file; ``--folds``."""

from __future__ import annotations

import csv
import json

import pytest
from cli_helpers import one_error_line, review_files, tiny_model

from headkit.cli.main import main

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("probe_save")
    return {"model": tiny_model(root), **review_files(root)}


def test_saved_probe_predicts_what_the_probe_predicted(files, tmp_path, capsys) -> None:
    head = tmp_path / "head"
    args = ["probe", "--model", str(files["model"]), "--data", str(files["train"])]
    args += ["--test-data", str(files["test"]), "--folds", "4", "--quiet"]
    assert main([*args, "--output", str(tmp_path / "p"), "--save", str(head)]) == 0
    out = capsys.readouterr().out
    assert "mean over 4 folds (folds)" in out and "per class" in out
    results = json.loads((tmp_path / "p" / "probe_results.json").read_text())
    assert results["settings"]["folds"] == 4
    shown = results["test_predictions"]
    from headkit import HeadedModel

    cfg = HeadedModel.from_pretrained(head).head_configs["probe"]
    assert (cfg.layer_hook, cfg.pooling) == (shown["layer"], shown["pooling"])
    predictions = tmp_path / "pred.csv"
    command = ["predict", str(head), "--data", str(files["test"]), "--output", str(predictions)]
    assert main([*command, "--quiet"]) == 0
    with open(predictions, newline="") as f:
        predicted = [r["probe"] for r in csv.DictReader(f)]
    assert predicted == shown["predictions"]  # the head predicts what the probe predicted
    assert main(["eval", str(head), "--data", str(files["test"]), "--quiet"]) == 0
    accuracy = [r for r in results["rows"] if r["layer"] == shown["layer"]][0]["accuracy"]
    assert f"{accuracy:.4f}" in capsys.readouterr().out


def test_save_is_checked_before_any_work(files, tmp_path, capsys) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    args = ["probe", "--model", str(files["model"]), "--data", str(files["train"]), "--quiet"]
    line = one_error_line(
        main([*args, "--output", str(tmp_path / "p"), "--save", str(taken)]),
        capsys.readouterr().err,
    )
    assert "--save=" in line and "notes.txt" in line
    assert not (tmp_path / "p").exists()
    line = one_error_line(
        main([*args, "--output", str(tmp_path / "q"), "--save", str(tmp_path / "q")]),
        capsys.readouterr().err,
    )
    assert "is --output; give the checkpoint its own folder" in line
    line = one_error_line(
        main([*args, "--output", str(tmp_path / "r"), "--folds", "3", "--val-splits", "2"]),
        capsys.readouterr().err,
    )
    assert "val_splits=2 and folds=3 were both given" in line
    line = one_error_line(
        main(
            [
                *args,
                "--output",
                str(tmp_path / "s"),
                "--image-column",
                "text",
                "--save",
                str(tmp_path / "head"),
            ]
        ),
        capsys.readouterr().err,
    )
    assert "writes a checkpoint that headkit predict reads texts with" in line
