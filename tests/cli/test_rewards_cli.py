"""``headkit train`` and ``headkit eval`` on reward data files: TRL's preference pairs (JSONL,
or CSV with conversations as JSON cells) and stepwise supervision."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from cli_helpers import one_error_line, tiny_model
from tiny_text import WORDS

from headkit.cli.datafiles import write_rows
from headkit.cli.main import main

pytestmark = pytest.mark.usefixtures("single_thread")


def sentence(rng: random.Random, extra: str | None = None) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 6))]
    if extra:
        words.insert(rng.randrange(len(words) + 1), extra)
    return " ".join(words)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pair_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"chosen": sentence(rng, "good"), "rejected": sentence(rng)} for _ in range(n)]


def test_train_and_eval_a_reward_head_on_preference_files(tmp_path, capsys):
    model = tiny_model(tmp_path)
    train = write_jsonl(tmp_path / "pairs.jsonl", pair_rows(96, 0))
    # the held-out file as CSV, the texts as one-message conversations in JSON cells
    rng = random.Random(1)
    chats = [
        {
            "chosen": json.dumps([{"role": "assistant", "content": sentence(rng, "good")}]),
            "rejected": json.dumps([{"role": "assistant", "content": sentence(rng)}]),
        }
        for _ in range(40)
    ]
    test = write_rows(tmp_path / "test.csv", chats)
    config = tmp_path / "rm.yaml"
    config.write_text(
        f"model: {model}\n"
        "heads: [{name: reward, pred_for_sequence: true, loss_fct: bradley_terry, pooling: mean,"
        " layer_hook: 0}]\n"
        f"data: {{train: {train}}}\n"
        "training: {epochs: 8, lr: 3.0e-2, batch_size: 16}\n"
    )
    tok_dir = Path(model)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok_config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = template
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(tok_config))
    assert main(["train", str(config), "--output", str(tmp_path / "rm"), "--quiet"]) == 0
    settings = json.loads((tmp_path / "rm" / "headkit_cli.json").read_text())
    assert settings["format"] == "pairs"
    capsys.readouterr()
    out = tmp_path / "metrics.json"
    assert (
        main(["eval", str(tmp_path / "rm"), "--data", str(test), "--output", str(out), "--quiet"])
        == 0
    )
    assert "pairwise_accuracy" in capsys.readouterr().out
    metrics = json.loads(out.read_text())["reward"]
    assert metrics["pairwise_accuracy"] > 0.8 and metrics["mean_margin"] > 0


def test_train_and_eval_a_prm_on_stepwise_files(tmp_path, capsys):
    model = tiny_model(tmp_path)
    rng = random.Random(0)
    rows = []
    for _ in range(80):
        wrong = [rng.random() < 0.4 for _ in range(3)]
        steps = [sentence(rng, "not" if w else None) for w in wrong]
        rows.append(
            {"prompt": sentence(rng), "completions": steps, "labels": [not w for w in wrong]}
        )
    train = write_jsonl(tmp_path / "steps.jsonl", rows[:60])
    test = write_jsonl(tmp_path / "steps_test.jsonl", rows[60:])
    config = tmp_path / "prm.yaml"
    config.write_text(
        f"model: {model}\n"
        "heads: [{name: prm, num_outputs: 2, layer_hook: 0, hidden_size: 32, num_layers: 2}]\n"
        f"data: {{train: {train}, eval: {test}, step_separator: '[SEP]'}}\n"
        "training: {epochs: 20, lr: 3.0e-2, batch_size: 16}\n"
    )
    assert main(["train", str(config), "--output", str(tmp_path / "prm"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "held-out metrics" in printed and "prm" in printed and "accuracy" in printed
    settings = json.loads((tmp_path / "prm" / "headkit_cli.json").read_text())
    assert settings["format"] == "steps" and settings["step_separator"] == "[SEP]"


def test_a_table_without_label_columns_is_refused_in_one_line(tmp_path, capsys):
    model = tiny_model(tmp_path)
    train = write_rows(tmp_path / "t.csv", [{"text": "w1 w2", "label": "a"}])
    config = tmp_path / "c.yaml"
    config.write_text(
        f"model: {model}\nheads: [{{name: h, pred_for_sequence: true}}]\n"
        f"data: {{train: {train}}}\noutput: {tmp_path / 'o'}\n"
    )
    line = one_error_line(main(["train", str(config), "--quiet"]), capsys.readouterr().err)
    assert "key 'data.label_columns' is missing" in line and "reward data" in line


def test_predict_writes_each_texts_reward(tmp_path):
    import csv

    model = tiny_model(tmp_path)
    train = write_jsonl(tmp_path / "pairs.jsonl", pair_rows(32, 0))
    config = tmp_path / "rm.yaml"
    config.write_text(
        f"model: {model}\n"
        "heads: [{name: reward, pred_for_sequence: true, loss_fct: bradley_terry, pooling: mean,"
        " layer_hook: 0}]\n"
        f"data: {{train: {train}}}\ntraining: {{epochs: 2}}\n"
    )
    assert main(["train", str(config), "--output", str(tmp_path / "rm"), "--quiet"]) == 0
    texts = write_rows(tmp_path / "texts.csv", [{"text": "w1 good w2"}, {"text": "w3 w4"}])
    out = tmp_path / "scores.csv"
    args = ["predict", str(tmp_path / "rm"), "--data", str(texts), "--output", str(out)]
    assert main([*args, "--quiet"]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [set(r) for r in rows] == [{"row", "text", "reward"}] * 2
    assert all(float(r["reward"]) == float(r["reward"]) for r in rows)  # a number, not a class
