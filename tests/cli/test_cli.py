"""The command line end to end: ``python -m headkit ...`` in a subprocess on small data files."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_text import planted_texts, save_tiny_text_model, tagged_sentences

from headkit.cli.datafiles import read_rows, write_rows
from headkit.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def headkit(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m headkit ARGS`` with this checkout first on the path, offline."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(
        [sys.executable, "-m", "headkit", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_text_model(tmp_path_factory.mktemp("tiny_bert"), num_layers=2)


@pytest.fixture(scope="module")
def reviews(tmp_path_factory) -> dict[str, Path]:
    """train.csv / test.csv: text, label ("pos" iff "good" occurs), score (count of "good")."""
    root = tmp_path_factory.mktemp("reviews")
    texts, labels, scores = planted_texts(300, seed=5)
    rows = [
        {"text": t, "label": "pos" if y else "neg", "score": s}
        for t, y, s in zip(texts, labels, scores)
    ]
    write_rows(root / "train.csv", rows[:240])
    write_rows(root / "test.csv", rows[240:])
    return {"train": root / "train.csv", "test": root / "test.csv", "rows": rows}


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln]
    assert len(errors) == 1, result.stderr
    return errors[0]


# ---------------------------------------------------------------------- discovery
def test_console_script_is_declared() -> None:
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"headkit": "headkit.cli:main"}
    module, _, name = scripts["headkit"].partition(":")
    assert getattr(__import__(module, fromlist=[name]), name) is main


@pytest.mark.parametrize("command", ["probe", "train", "eval", "predict", "demo"])
def test_every_command_has_help_with_an_example(command, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: headkit {command}" in out
    assert "example:" in out and f"headkit {command}" in out.split("example:")[1]


# ---------------------------------------------------------------------- probe
def test_probe_csv(model_dir, reviews, tmp_path) -> None:
    out = tmp_path / "probe"
    args = ["--model", str(model_dir), "--data", str(reviews["train"]), "--layers", "0,-1"]
    args += ["--pooling", "mean,first", "--control", "--seeds", "2", "--output", str(out)]
    result = headkit("probe", *args)
    assert result.returncode == 0, result.stderr
    assert "selectivity" in result.stdout and "best on validation" in result.stdout
    data = json.loads((out / "probe_results.json").read_text())
    assert data["classes"] == ["neg", "pos"] and data["poolings"] == ["mean", "first"]
    assert [r["layer"] for r in data["rows"]] == [0, 2, 0, 2]
    assert all("accuracy" in r and "selectivity" in r and "ci95" in r for r in data["rows"])
    assert (out / "probe_results.png").read_bytes()[:4] == b"\x89PNG"


def test_probe_token_task_jsonl(model_dir, tmp_path) -> None:
    words, tags = tagged_sentences(100)
    data = tmp_path / "tags.jsonl"
    write_rows(data, [{"words": w, "tags": t} for w, t in zip(words, tags)])
    out = tmp_path / "probe"
    result = headkit(
        "probe",
        "--model",
        str(model_dir),
        "--data",
        str(data),
        "--task",
        "token",
        "--text-column",
        "words",
        "--label-column",
        "tags",
        "--seeds",
        "1",
        "--quiet",
        "--output",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    got = json.loads((out / "probe_results.json").read_text())
    assert got["task"] == "token" and got["classes"] == ["CUE", "NEG", "W"]
    assert got["n_train"] + got["n_test"] == sum(len(w) for w in words)


@pytest.mark.slow
def test_probe_regression_parquet(model_dir, reviews, tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = reviews["rows"]
    data = tmp_path / "reviews.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    assert read_rows(data) == rows
    out = tmp_path / "probe"
    result = headkit(
        "probe",
        "--model",
        str(model_dir),
        "--data",
        str(data),
        "--task",
        "regression",
        "--label-column",
        "score",
        "--layers",
        "0",
        "--quiet",
        "--output",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    row = json.loads((out / "probe_results.json").read_text())["rows"][0]
    assert "r2" in row and "train_r2" in row and row["r2"] > 0.3


@pytest.mark.slow
def test_probe_saved_dataset(model_dir, reviews, tmp_path) -> None:
    import datasets

    rows = reviews["rows"]
    folder = tmp_path / "ds"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "dd")
    )
    assert read_rows(folder, limit=5) == rows[:5]
    out = tmp_path / "probe"
    result = headkit(
        "probe",
        "--model",
        str(model_dir),
        "--data",
        str(folder),
        "--layers",
        "-1",
        "--quiet",
        "--output",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "probe_results.json").read_text())["metric"] == "accuracy"
    line = _one_error_line(
        headkit(
            "probe", "--model", str(model_dir), "--data", str(tmp_path / "dd"), "--output", str(out)
        )
    )
    assert "DatasetDict with splits ['train']" in line and str(tmp_path / "dd" / "train") in line


# ---------------------------------------------------------------------- train / eval / predict
def _config(tmp_path: Path, reviews: dict, model_dir: Path) -> Path:
    config = tmp_path / "train.yaml"
    config.write_text(
        f"""
model: {model_dir}
heads:
  - {{name: sentiment, layer_hook: 0, pred_for_sequence: true, pooling: mean, output_bias: true}}
  - {{name: goods, layer_hook: -1, pred_for_sequence: true, pooling: mean, is_regression: true,
     loss_fct: mse, output_bias: true}}
data:
  train: {reviews["train"]}
  eval: {reviews["test"]}
  text_column: text
  label_columns: {{sentiment: label, goods: score}}
training: {{epochs: 30, batch_size: 16, lr: 1.0e-2, seed: 0}}
output: ckpt
"""
    )
    return config


def test_train_eval_predict(model_dir, reviews, tmp_path) -> None:
    result = headkit("train", str(_config(tmp_path, reviews, model_dir)), "--quiet")
    assert result.returncode == 0, result.stderr
    assert "held-out metrics" in result.stdout and "sentiment" in result.stdout
    ckpt = tmp_path / "ckpt"  # relative to the config's folder
    assert (ckpt / "head_configs.json").is_file() and (ckpt / "tokenizer.json").is_file()
    heads = json.loads((ckpt / "head_configs.json").read_text())["heads"]
    sentiment = next(h for h in heads if h["name"] == "sentiment")
    assert sentiment["num_outputs"] == 2 and sentiment["extra"]["classes"] == ["neg", "pos"]

    result = headkit(
        "eval",
        str(ckpt),
        "--data",
        str(reviews["test"]),
        "--output",
        str(tmp_path / "m.json"),
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["sentiment"]["accuracy"] > 0.8  # "good" in the text, on the embeddings
    assert {"mse", "mae", "r2"} <= set(metrics["goods"])

    out = tmp_path / "pred.csv"
    result = headkit("predict", str(ckpt), "--data", str(reviews["test"]), "--output", str(out))
    assert result.returncode == 0, result.stderr
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 60 and list(rows[0]) == ["text", "sentiment", "sentiment_prob", "goods"]
    assert {r["sentiment"] for r in rows} <= {"neg", "pos"}
    assert all(0.5 <= float(r["sentiment_prob"]) <= 1.0 for r in rows)
    agree = sum((r["sentiment"] == "pos") == ("good" in r["text"]) for r in rows) / len(rows)
    assert agree == pytest.approx(metrics["sentiment"]["accuracy"])


@pytest.mark.slow
def test_token_head_train_and_predict_jsonl(model_dir, tmp_path) -> None:
    words, tags = tagged_sentences(120, seed=1)
    write_rows(tmp_path / "tags.jsonl", [{"words": w, "tags": t} for w, t in zip(words, tags)])
    (tmp_path / "tags.yaml").write_text(
        f"""
model: {model_dir}
heads: [{{name: tagger, layer_hook: 0, output_bias: true}}]
data: {{train: tags.jsonl, text_column: words, label_columns: {{tagger: tags}}}}
training: {{epochs: 20, lr: 1.0e-2}}
output: tagger
"""
    )
    result = headkit("train", str(tmp_path / "tags.yaml"), "--quiet")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "pred.jsonl"
    result = headkit(
        "predict",
        str(tmp_path / "tagger"),
        "--data",
        str(tmp_path / "tags.jsonl"),
        "--output",
        str(out),
        "--limit",
        "10",
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    rows = read_rows(out)
    assert len(rows) == 10
    for r, w in zip(rows, words):
        assert len(r["tagger"]) == len(w) == len(r["tagger_prob"])  # one tag per word
        assert set(r["tagger"]) <= {"CUE", "NEG", "W"}
    cue = [t for r, w in zip(rows, words) for t, x in zip(r["tagger"], w) if x == "unhappy"]
    assert cue and all(t == "CUE" for t in cue)  # two sub-tokens, tagged by the first


# ---------------------------------------------------------------------- errors
def test_missing_column_lists_the_columns_present(model_dir, reviews, tmp_path) -> None:
    result = headkit(
        "probe",
        "--model",
        str(model_dir),
        "--data",
        str(reviews["train"]),
        "--label-column",
        "lable",
        "--output",
        str(tmp_path),
    )
    line = _one_error_line(result)
    assert "--label-column='lable'" in line and "columns present: text, label, score" in line


def test_layer_out_of_range_names_the_option_and_the_range(model_dir, reviews, tmp_path) -> None:
    result = headkit(
        "probe",
        "--model",
        str(model_dir),
        "--data",
        str(reviews["train"]),
        "--layers",
        "0,9",
        "--output",
        str(tmp_path),
        "--quiet",
    )
    line = _one_error_line(result)
    assert "argument --layers: layers='0,9': 9 is out of range" in line
    assert "allowed: 'all', indices -3..2" in line


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["probe", "--model", "m", "--data", "d.csv", "--output", "o", "--seeds", "0"],
            "argument --seeds: invalid value '0'; allowed: an integer >= 1",
        ),
        (
            ["probe", "--model", "m", "--data", "d.csv", "--output", "o", "--layers", "x"],
            "argument --layers: invalid value 'x'; allowed: 'all'",
        ),
        (
            ["probe", "--model", "m", "--data", "d.csv", "--output", "o", "--pooling", "mode"],
            "argument --pooling: pooling='mode': 'mode' is not a pooling; allowed: ",
        ),
        (
            ["probe", "--model", "m", "--data", "d.csv", "--output", "o", "--task", "tags"],
            "argument --task: invalid choice: 'tags'",
        ),
        (["probe", "--model", "m", "--output", "o"], "the following arguments are required"),
        (["fly"], "argument COMMAND: invalid choice: 'fly'"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, message, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err


def test_bad_inputs_exit_2_naming_what_is_wrong(tmp_path, reviews, capsys) -> None:
    (tmp_path / "d.xlsx").write_text("x")
    config = tmp_path / "c.yaml"
    config.write_text("model: m\nheads: [{name: a}]\ndata: {train: x.csv}\noutput: o\nepochs: 3\n")
    cases = [
        (
            ["probe", "--model", "m", "--data", str(tmp_path / "d.xlsx"), "--output", "o"],
            "argument --data: data file",
        ),
        (
            ["probe", "--model", "m", "--data", str(tmp_path / "none.csv"), "--output", "o"],
            "does not exist; allowed: CSV",
        ),
        (["train", str(config)], "unknown key(s) ['epochs']; allowed: data, heads, model"),
        (["train", str(tmp_path / "missing.yaml")], "argument CONFIG: CONFIG="),
        (["eval", str(tmp_path), "--data", str(reviews["test"])], "head_configs.json"),
    ]
    for args, message in cases:
        assert main(args) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err, (args, err)


def test_train_with_the_backbone_unfrozen_saves_it(model_dir, reviews, tmp_path, capsys) -> None:
    """freeze_backbone: false trains through the whole model (no cached features); in-process."""
    config = _config(tmp_path, reviews, model_dir)
    text = config.read_text().replace("seed: 0}", "seed: 0, freeze_backbone: false, epochs: 1}")
    text = text.replace("label_columns:", "limit: 48\n  label_columns:")
    config.write_text(text.replace("epochs: 30, ", ""))
    assert main(["train", str(config), "--quiet", "--output", str(tmp_path / "ft")]) == 0
    assert "held-out metrics" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "ft" / "head_configs.json").read_text())
    assert manifest["backbone"]["kind"] == "saved"  # it changed, so it is copied
    config.write_text(
        config.read_text().replace(
            "freeze_backbone: false", "freeze_backbone: false, use_cached_features: true"
        )
    )
    assert main(["train", str(config), "--quiet"]) == 2
    assert "use_cached_features=true needs training.freeze_backbone=true" in capsys.readouterr().err
