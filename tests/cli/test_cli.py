"""The command line end to end on small data files: ``main([...])`` in process.

Each entry point also runs once in a subprocess (the console script and ``python -m
headkit``), and ``--help`` is checked in a fresh interpreter for what it imports.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.nn.functional as F
import yaml
from tiny_text import planted_texts, save_tiny_text_model, tagged_sentences
from transformers.utils import logging as hf_logging

from headkit import LOSSES, LossSpec
from headkit.cli.datafiles import read_rows, write_rows
from headkit.cli.main import COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("single_thread")


def _env() -> dict[str, str]:
    """This checkout first on the path, offline, one thread."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def run_side_by_side(commands: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess]:
    """Run the commands at the same time; name -> its finished process (output as text)."""
    started = {
        name: subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
        )
        for name, command in commands.items()
    }
    try:
        done = {}
        for name, process in started.items():
            out, err = process.communicate(timeout=300)
            done[name] = subprocess.CompletedProcess(commands[name], process.returncode, out, err)
        return done
    finally:
        for process in started.values():
            if process.poll() is None:
                process.kill()
                process.wait()


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


def _one_error_line(code: int, err: str) -> str:
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln]
    assert len(errors) == 1, err
    return errors[0]


# ---------------------------------------------------------------------- entry points
def test_console_script_is_declared() -> None:
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"headkit": "headkit.cli:main"}
    module, _, name = scripts["headkit"].partition(":")
    assert getattr(__import__(module, fromlist=[name]), name) is main


@pytest.fixture(scope="module")
def smoke_runs(model_dir, reviews, tmp_path_factory) -> dict[str, tuple]:
    """Each entry point in a fresh interpreter, side by side: ``python -m headkit`` runs a
    probe on the tiny model; the installed console script (the same ``main``, see above)
    prints the probe's help, which imports no torch. entry point -> (process, output)."""
    script = shutil.which("headkit", path=str(Path(sys.executable).parent))
    assert script, f"no headkit console script next to {sys.executable} (pip install -e .)"
    out = tmp_path_factory.mktemp("smoke")
    args = ["probe", "--model", str(model_dir), "--data", str(reviews["test"])]
    args += ["--layers", "0", "--val-splits", "1", "--quiet", "--output", str(out)]
    commands = {
        "python -m": [sys.executable, "-m", "headkit", *args],
        "console script": [script, "probe", "--help"],
    }
    runs = run_side_by_side(commands)
    return {"python -m": (runs["python -m"], out), "console script": (runs["console script"], None)}


@pytest.mark.slow
def test_python_m_headkit_runs_a_probe(smoke_runs) -> None:
    result, out = smoke_runs["python -m"]
    assert result.returncode == 0, result.stderr
    assert "best on validation" in result.stdout and f"wrote {out}" in result.stdout
    assert json.loads((out / "probe_results.json").read_text())["n_test"] == 12


@pytest.mark.slow
def test_the_console_script_runs_main(smoke_runs) -> None:
    result, _ = smoke_runs["console script"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: headkit probe") and "--layers" in result.stdout


def test_help_and_usage_errors_import_no_torch() -> None:
    """``headkit --help``, every ``headkit CMD --help`` and a usage error (here a missing
    option) come from argparse alone: torch, transformers, numpy, yaml, pydantic stay
    unimported."""
    code = f"""
import sys
from headkit.cli.main import main
runs = [["--help"]] + [[c, "--help"] for c in {sorted(COMMANDS)!r}]
for argv, status in [(a, 0) for a in runs] + [(["probe", "--model", "m", "--output", "o"], 2)]:
    try:
        main(argv)
    except SystemExit as e:
        assert e.code == status, (argv, e.code)
heavy = ("torch", "transformers", "numpy", "yaml", "tqdm", "safetensors", "tokenizers", "pydantic")
print("HEAVY", sorted(m for m in sys.modules if m.split(".")[0] in heavy))
"""
    result = run_side_by_side({"help": [sys.executable, "-c", code]})["help"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("usage: headkit") == 1 + len(COMMANDS)
    assert "the following arguments are required: --data" in result.stderr
    assert result.stdout.splitlines()[-1] == "HEAVY []"


@pytest.mark.parametrize("command", ["probe", "train", "eval", "predict", "demo"])
def test_every_command_has_help_with_an_example(command, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: headkit {command}" in out
    assert "example:" in out and f"headkit {command}" in out.split("example:")[1]


# ---------------------------------------------------------------------- probe
def test_probe_csv(model_dir, reviews, tmp_path, capsys) -> None:
    out = tmp_path / "probe"
    args = ["--model", str(model_dir), "--data", str(reviews["train"]), "--layers", "0,-1"]
    args += ["--pooling", "mean,first", "--control", "--val-splits", "2", "--output", str(out)]
    assert main(["probe", *args]) == 0
    captured = capsys.readouterr()
    assert "selectivity" in captured.out and "best on validation" in captured.out
    assert "Loading weights" in captured.err  # transformers' bar: shown without --quiet
    data = json.loads((out / "probe_results.json").read_text())
    assert data["classes"] == ["neg", "pos"] and data["poolings"] == ["mean", "first"]
    assert [r["layer"] for r in data["rows"]] == [0, 2, 0, 2]
    assert all("accuracy" in r and "selectivity" in r and "ci95" in r for r in data["rows"])
    assert all(r["std"] is not None for r in data["rows"])  # two validation splits
    assert (out / "probe_results.png").read_bytes()[:4] == b"\x89PNG"


def test_probe_token_task_jsonl_quiet(model_dir, tmp_path, capsys) -> None:
    """``--quiet``: no bar at all on stderr (transformers' loading bar included), and the
    bars are back on once ``main`` returns."""
    words, tags = tagged_sentences(100)
    data = tmp_path / "tags.jsonl"
    write_rows(data, [{"words": w, "tags": t} for w, t in zip(words, tags)])
    out = tmp_path / "probe"
    args = ["--model", str(model_dir), "--data", str(data), "--task", "token"]
    args += ["--text-column", "words", "--label-column", "tags", "--val-splits", "1"]
    assert main(["probe", *args, "--quiet", "--output", str(out)]) == 0
    assert capsys.readouterr().err == ""
    assert hf_logging.is_progress_bar_enabled()
    got = json.loads((out / "probe_results.json").read_text())
    assert got["task"] == "token" and got["classes"] == ["CUE", "NEG", "W"]
    assert got["n_train"] + got["n_test"] == sum(len(w) for w in words)


def test_probe_regression_parquet(model_dir, reviews, tmp_path, capsys) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = reviews["rows"]
    data = tmp_path / "reviews.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    assert read_rows(data) == rows
    out = tmp_path / "probe"
    args = ["--model", str(model_dir), "--data", str(data), "--task", "regression"]
    args += ["--label-column", "score", "--layers", "0", "--quiet", "--output", str(out)]
    assert main(["probe", *args]) == 0, capsys.readouterr().err
    row = json.loads((out / "probe_results.json").read_text())["rows"][0]
    assert "r2" in row and "train_r2" in row and row["r2"] > 0.3


def test_probe_saved_dataset(model_dir, reviews, tmp_path, capsys) -> None:
    import datasets

    rows = reviews["rows"]
    folder = tmp_path / "ds"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "dd")
    )
    assert read_rows(folder, limit=5) == rows[:5]
    out = tmp_path / "probe"
    args = ["--model", str(model_dir), "--data", str(folder), "--layers", "-1", "--quiet"]
    assert main(["probe", *args, "--output", str(out)]) == 0, capsys.readouterr().err
    assert json.loads((out / "probe_results.json").read_text())["metric"] == "accuracy"
    capsys.readouterr()
    args = ["--model", str(model_dir), "--data", str(tmp_path / "dd"), "--output", str(out)]
    line = _one_error_line(main(["probe", *args, "--overwrite"]), capsys.readouterr().err)
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


def test_train_eval_predict(model_dir, reviews, tmp_path, capsys) -> None:
    assert main(["train", str(_config(tmp_path, reviews, model_dir)), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "held-out metrics" in out and "sentiment" in out
    ckpt = tmp_path / "ckpt"  # relative to the config's folder
    assert (ckpt / "head_configs.json").is_file() and (ckpt / "tokenizer.json").is_file()
    heads = json.loads((ckpt / "head_configs.json").read_text())["heads"]
    sentiment = next(h for h in heads if h["name"] == "sentiment")
    assert sentiment["num_outputs"] == 2 and sentiment["extra"]["classes"] == ["neg", "pos"]
    # the card records the held-out metrics, on which data, as text and as model-index
    card = (ckpt / "README.md").read_text()
    meta = yaml.safe_load(card.split("---\n")[1])
    (index,) = meta["model-index"]
    results = {r["task"]["name"]: r for r in index["results"]}
    assert results["sentiment"]["task"]["type"] == "text-classification"
    assert results["sentiment"]["dataset"]["name"] == str(reviews["test"])
    accuracy = {m["type"]: m["value"] for m in results["sentiment"]["metrics"]}["accuracy"]
    assert "accuracy" in meta["metrics"] and "r2" in meta["metrics"]
    assert f"| sentiment | accuracy | {accuracy:.4f} |" in card
    assert f"Trained on `{reviews['train']}`" in card.replace("\\", "")

    args = ["eval", str(ckpt), "--data", str(reviews["test"])]
    assert main([*args, "--output", str(tmp_path / "m.json"), "--quiet"]) == 0
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["sentiment"]["accuracy"] > 0.8  # "good" in the text, on the embeddings
    assert metrics["sentiment"]["accuracy"] == pytest.approx(accuracy)  # what the card says
    assert {"mse", "mae", "r2"} <= set(metrics["goods"])

    out = tmp_path / "pred.csv"
    assert main(["predict", str(ckpt), "--data", str(reviews["test"]), "--output", str(out)]) == 0
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 60 and list(rows[0]) == [
        *("row", "text", "sentiment", "sentiment_prob"),
        *("sentiment_prob_neg", "sentiment_prob_pos", "goods"),
    ]
    assert [r["row"] for r in rows] == [str(i) for i in range(60)]
    assert {r["sentiment"] for r in rows} <= {"neg", "pos"}
    for r in rows:  # the class's probability is the larger of the per-class ones
        per_class = float(r["sentiment_prob_neg"]), float(r["sentiment_prob_pos"])
        assert sum(per_class) == pytest.approx(1.0, abs=1e-5)
        assert float(r["sentiment_prob"]) == pytest.approx(max(per_class))
    assert all(0.5 <= float(r["sentiment_prob"]) <= 1.0 for r in rows)
    agree = sum((r["sentiment"] == "pos") == ("good" in r["text"]) for r in rows) / len(rows)
    assert agree == pytest.approx(metrics["sentiment"]["accuracy"])


def _my_bce(p, y):
    return F.binary_cross_entropy_with_logits(p, y, reduction="none")


@pytest.fixture
def my_bce():
    """A user-registered binary loss (on logits, threshold 0)."""
    LOSSES.register(
        "my_bce", LossSpec(_my_bce, ignores_minus_100=True, target_range=(0, 1), metric="binary")
    )
    yield "my_bce"
    LOSSES.remove("my_bce")


@pytest.mark.parametrize("loss", ["BCE", "my_bce"], ids=["bce", "registered"])
def test_binary_heads_predict_both_classes(loss, my_bce, model_dir, reviews, tmp_path, capsys):
    """A head is binary by its loss's LossSpec, whatever the name's case or who registered
    it: its labels are read as numbers, it keeps one output, and predict writes the 0/1
    decision and a probability that agree with eval's accuracy."""
    rows = [
        {"text": r["text"], "good": int(r["label"] == "pos")} for r in read_rows(reviews["train"])
    ]
    write_rows(tmp_path / "train.csv", rows[:180])
    write_rows(tmp_path / "test.csv", rows[180:])
    sigmoid = ", output_activation: sigmoid" if loss == "BCE" else ""
    (tmp_path / "binary.yaml").write_text(
        f"""
model: {model_dir}
heads:
  - {{name: good, layer_hook: 0, pred_for_sequence: true, pooling: mean, output_bias: true,
     loss_fct: {loss}{sigmoid}}}
data: {{train: train.csv, eval: test.csv, label_columns: {{good: good}}}}
training: {{epochs: 20, batch_size: 32, lr: 5.0e-2}}
output: ckpt
"""
    )
    assert main(["train", str(tmp_path / "binary.yaml"), "--quiet"]) == 0, capsys.readouterr()
    head = json.loads((tmp_path / "ckpt" / "head_configs.json").read_text())["heads"][0]
    assert head.get("num_outputs", 1) == 1 and "classes" not in head.get("extra", {})
    args = ["--data", str(tmp_path / "test.csv"), "--quiet"]
    assert main(["eval", str(tmp_path / "ckpt"), *args, "--output", str(tmp_path / "m.json")]) == 0
    accuracy = json.loads((tmp_path / "m.json").read_text())["good"]["accuracy"]
    assert accuracy > 0.8
    out = tmp_path / "pred.jsonl"
    assert main(["predict", str(tmp_path / "ckpt"), *args, "--output", str(out)]) == 0
    preds = read_rows(out)
    assert {p["good"] for p in preds} == {0, 1}
    assert all(0.0 < p["good_prob"] < 1.0 for p in preds)
    assert all(p["good"] == int(p["good_prob"] > 0.5) for p in preds)
    agree = sum(p["good"] == ("good" in p["text"]) for p in preds) / len(preds)
    assert agree == pytest.approx(accuracy)


def test_token_head_train_and_predict_jsonl(model_dir, tmp_path, capsys) -> None:
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
    assert main(["train", str(tmp_path / "tags.yaml"), "--quiet"]) == 0, capsys.readouterr()
    out = tmp_path / "pred.jsonl"
    args = ["--data", str(tmp_path / "tags.jsonl"), "--output", str(out), "--limit", "10"]
    assert main(["predict", str(tmp_path / "tagger"), *args, "--quiet"]) == 0
    rows = read_rows(out)
    assert len(rows) == 10
    for r, w in zip(rows, words):
        assert len(r["tagger"]) == len(w) == len(r["tagger_prob"])  # one tag per word
        assert set(r["tagger"]) <= {"CUE", "NEG", "W"}
    cue = [t for r, w in zip(rows, words) for t, x in zip(r["tagger"], w) if x == "unhappy"]
    assert cue and all(t == "CUE" for t in cue)  # two sub-tokens, tagged by the first


def test_train_with_the_backbone_unfrozen_saves_it(model_dir, reviews, tmp_path, capsys) -> None:
    """freeze_backbone: false trains through the whole model (no cached features)."""
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


# ---------------------------------------------------------------------- errors
def test_missing_column_lists_the_columns_present(model_dir, reviews, tmp_path, capsys) -> None:
    args = ["--model", str(model_dir), "--data", str(reviews["train"])]
    code = main(["probe", *args, "--label-column", "lable", "--output", str(tmp_path)])
    line = _one_error_line(code, capsys.readouterr().err)
    assert "--label-column='lable'" in line and "columns present: text, label, score" in line


def test_layer_out_of_range_names_the_option_and_the_range(
    model_dir, reviews, tmp_path, capsys
) -> None:
    args = ["--model", str(model_dir), "--data", str(reviews["train"]), "--layers", "0,9"]
    code = main(["probe", *args, "--output", str(tmp_path), "--quiet"])
    line = _one_error_line(code, capsys.readouterr().err)
    assert "argument --layers: layers='0,9': 9 is out of range" in line
    assert "allowed: 'all', indices -3..2" in line


_PROBE = ["probe", "--model", "m", "--data", "d.csv", "--output", "o"]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            [*_PROBE, "--val-splits", "0"],
            "argument --val-splits: invalid value '0'; allowed: an integer from 1 to 100",
        ),
        ([*_PROBE, "--layers", "x"], "argument --layers: invalid value 'x'; allowed: 'all'"),
        (
            [*_PROBE, "--pooling", "mode"],
            "argument --pooling: pooling='mode': 'mode' is not a pooling; allowed: ",
        ),
        ([*_PROBE, "--task", "tags"], "argument --task: invalid choice: 'tags'"),
        ([*_PROBE, "--seeds", "3"], "unrecognized arguments: --seeds 3"),
        (["demo", "--val-splits", "-1"], "argument --val-splits: invalid value '-1'"),
        (["probe", "--model", "m", "--output", "o"], "the following arguments are required"),
        (["fly"], "argument COMMAND: invalid choice: 'fly'"),
        ([], "headkit: error: the following arguments are required: COMMAND"),
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
