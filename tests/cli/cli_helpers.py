"""Small files for command-line tests: a tiny text model, labelled texts, a trained checkpoint,
and the one-error-line check."""

from __future__ import annotations

from pathlib import Path

from tiny_text import planted_texts, save_tiny_text_model

from headkit.cli.datafiles import write_rows
from headkit.cli.main import main


def tiny_model(root: Path) -> Path:
    """A tiny random BERT with its word-piece tokenizer, saved under ``root``."""
    return save_tiny_text_model(root / "tiny_bert", num_layers=2)


def review_files(root: Path, n: int = 200) -> dict[str, Path]:
    """``train.csv`` (80%) and ``test.csv``: text, label ("pos" iff "good" occurs)."""
    texts, labels, _ = planted_texts(n, seed=5)
    rows = [{"text": t, "label": "pos" if y else "neg"} for t, y in zip(texts, labels)]
    cut = n * 4 // 5
    return {
        "train": write_rows(root / "train.csv", rows[:cut]),
        "test": write_rows(root / "test.csv", rows[cut:]),
    }


def write_config(
    path: Path, model: Path, train: Path, training: str = "{}", extra: str = ""
) -> Path:
    """A train config for one sentiment head on layer 0 of ``model``."""
    path.write_text(
        f"model: {model}\n"
        "heads: [{name: sentiment, layer_hook: 0, pred_for_sequence: true, pooling: mean,"
        " output_bias: true}]\n"
        f"data: {{train: {train}, label_columns: {{sentiment: label}}}}\n"
        f"training: {training}\n{extra}"
    )
    return path


def train_checkpoint(root: Path, model: Path, train: Path) -> Path:
    """A checkpoint ``headkit train`` wrote (a few epochs), at ``root/ckpt``."""
    config = write_config(root / "train.yaml", model, train, "{epochs: 3, lr: 1.0e-2}")
    assert main(["train", str(config), "--output", str(root / "ckpt"), "--quiet"]) == 0
    return root / "ckpt"


def one_error_line(code: int, err: str) -> str:
    """Exit status 2 and exactly one ``error:`` line on stderr; returns that line."""
    assert code == 2, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    return errors[0]
