"""``headkit probe --test-data`` scores on the given file; ``--layers -4:`` parses; ``predict``
writes CSV to standard output without ``--output``; ``--quiet`` silences transformers' load
reports; the probe's plot says what its error bars are."""

from __future__ import annotations

import csv
import io
import json
import logging
import shutil

import pytest
from cli_helpers import one_error_line, review_files, tiny_model, train_checkpoint
from conftest import build_tiny
from tiny_text import tiny_tokenizer
from transformers.utils import logging as hf_logging

from headkit.cli.datafiles import read_rows
from headkit.cli.main import main
from headkit.errors import ConfigError
from headkit.probe.results import ProbeResults, ProbeRow

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("probe_predict")
    model = tiny_model(root)
    data = review_files(root)
    return {
        "root": root,
        "model": model,
        **data,
        "ckpt": train_checkpoint(root, model, data["train"]),
    }


def _probe(files: dict, out, *extra: str) -> list[str]:
    return ["probe", "--model", str(files["model"]), "--data", str(files["train"]), *extra]


def test_test_data_is_the_split_scored_and_n_test_its_row_count(files, tmp_path, capsys):
    args = [*_probe(files, tmp_path), "--test-data", str(files["test"]), "--layers", "0"]
    assert main([*args, "--val-splits", "1", "--quiet", "--output", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "probe_results.json").read_text())
    assert got["n_test"] == len(read_rows(files["test"])) == 40
    assert got["n_train"] == len(read_rows(files["train"])) == 160
    assert got["settings"]["n_test_examples"] == 40 and "test_fraction" not in got["settings"]
    assert got["test_index"] == list(range(40))
    capsys.readouterr()
    both = [*args, "--test-fraction", "0.3", "--output", str(tmp_path / "b")]
    line = one_error_line(main(both), capsys.readouterr().err)
    assert "pass one of them" in line
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("text,label\nw1 good,pos\nw2,neg,extra\n")
    args = [*_probe(files, tmp_path), "--test-data", str(ragged), "--output", str(tmp_path / "r")]
    line = one_error_line(main(args), capsys.readouterr().err)
    assert f"error: --test-data='{ragged}': {ragged}: row 1 (line 3) has 3 fields" in line


@pytest.mark.parametrize("spelling", [["--layers", "-2:"], ["--layers=-2:"]])
def test_layers_may_start_with_a_minus(files, tmp_path, spelling) -> None:
    args = [*_probe(files, tmp_path), *spelling, "--val-splits", "1", "--quiet"]
    assert main([*args, "--output", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "probe_results.json").read_text())["layers"] == [1, 2]


def test_predict_without_output_writes_csv_to_standard_output_only(files, capsys) -> None:
    assert main(["predict", str(files["ckpt"]), "--data", str(files["test"]), "--limit", "5"]) == 0
    captured = capsys.readouterr()
    rows = list(csv.DictReader(io.StringIO(captured.out)))
    assert list(rows[0]) == [
        *("row", "sentiment", "sentiment_prob", "sentiment_prob_neg", "sentiment_prob_pos")
    ]
    assert [r["row"] for r in rows] == ["0", "1", "2", "3", "4"]
    assert all(r["sentiment"] in ("neg", "pos") for r in rows)
    assert "wrote" not in captured.out and "Loading" not in captured.out


class _Kept(logging.Handler):
    """Keeps the messages transformers logs (its own handler writes to the stderr it found
    at import, which the test's capture does not see)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_quiet_silences_transformers_load_reports(files, tmp_path, capsys) -> None:
    """A classifier's folder loaded as a bare backbone makes transformers log a load report
    (its classifier weights are unexpected): logged without --quiet, not with it (and no
    bar on stderr), and transformers' verbosity is back afterwards."""
    folder = tmp_path / "classifier"
    build_tiny("bert", num_layers=2, task="sequence-classification").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    args = ["probe", "--model", str(folder), "--data", str(files["train"]), "--layers", "0"]
    args += ["--val-splits", "1"]
    verbosity = hf_logging.get_verbosity()
    kept = _Kept()
    logger = logging.getLogger("transformers")
    logger.addHandler(kept)
    try:
        assert main([*args, "--output", str(tmp_path / "loud")]) == 0
        assert any("LOAD REPORT" in m for m in kept.messages)
        capsys.readouterr()
        kept.messages.clear()
        assert main([*args, "--output", str(tmp_path / "quiet"), "--quiet"]) == 0
        assert kept.messages == [] and capsys.readouterr().err == ""
    finally:
        logger.removeHandler(kept)
    assert hf_logging.get_verbosity() == verbosity and hf_logging.is_progress_bar_enabled()


def test_the_plot_says_its_error_bars_are_95_percent_bootstrap_intervals() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    row = ProbeRow(0, "mean", 0.8, 0.9, 0.8, None, (0.7, 0.9), 0.5, [0.1])
    results = ProbeResults("classification", "accuracy", "m", 2, [row], 0.5, 8, 2, 1, False, [])
    fig, ax = plt.subplots()
    results.plot(ax=ax)
    assert "error bars: 95% bootstrap interval" in ax.get_ylabel()
    plt.close(fig)


def test_a_dtype_is_checked_by_name_before_the_model_is_loaded(files, tmp_path, capsys):
    args = ["probe", "--model", "/nonexistent", "--data", str(files["train"]), "--output"]
    args += [str(tmp_path), "--model-kwarg", "torch_dtype=bogus"]
    line = one_error_line(main(args), capsys.readouterr().err)
    assert "--model-kwarg torch_dtype='bogus' is invalid; allowed: auto, bfloat16, " in line


@pytest.mark.parametrize(
    "settings, message",
    [
        ("{not json", "headkit_cli.json is not valid JSON"),
        ("[1, 2]", "headkit_cli.json must hold a JSON object"),
        ('{"max_length": "long"}', "max_length='long' is invalid; allowed: an integer >= 1"),
        ('{"label_columns": ["label"]}', "label_columns=['label'] is invalid; allowed: a mapping"),
    ],
)
def test_a_corrupt_cli_settings_file_is_one_line(files, tmp_path, capsys, settings, message):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(files["ckpt"], ckpt)
    (ckpt / "headkit_cli.json").write_text(settings)
    args = ["eval", str(ckpt), "--data", str(files["test"]), "--quiet"]
    line = one_error_line(main(args), capsys.readouterr().err)
    assert f"CHECKPOINT='{ckpt}': " in line and message in line


def test_a_probe_row_built_by_hand_has_no_head() -> None:
    row = ProbeRow(0, "mean", 0.8, 0.9, 0.8, None, (0.7, 0.9), 0.5, [0.1])
    results = ProbeResults("classification", "accuracy", "m", 2, [row], 0.5, 8, 2, 1, False, [0.1])
    with pytest.raises(ConfigError, match=r"the probe of layer 0 \(mean\) has no weights"):
        results.to_headed()
