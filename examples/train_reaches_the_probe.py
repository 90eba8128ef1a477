"""Does ``headkit train`` with its defaults reach the probe's held-out accuracy?

For each corpus — the packaged rotten-tomatoes reviews (2 classes) and the 2016 presidential
debates (each sentence and its speaker: 9 classes) — the rows are split once into
``train.csv`` and ``test.csv``, then, through the command line's own code (``headkit.cli.main``):

1. ``headkit probe --model packaged:minilm --data train.csv --test-data test.csv`` picks the
   layer on validation and scores its probe on ``test.csv``;
2. ``headkit train`` trains a linear head (mean pooling, bias) on that layer from a config
   with **no training section** — every training setting at its default — and
   ``headkit eval`` scores it on the same ``test.csv``.

The goal: the head within 0.02 of the probe on both corpora. ``--previous`` also trains with
the defaults ``headkit train`` had before early stopping (10 epochs, lr 1e-3, no validation
split), for comparison. The commands are printed as they would be typed; ``OUT/results.json``
keeps the numbers. Exits 1 when a gap exceeds the goal. About 40 minutes on 2 shared CPU
cores with ``--previous`` (measured: docs/cli.md).

Run: ``HF_HUB_OFFLINE=1 python examples/train_reaches_the_probe.py [--reviews 4000]
[--previous] [--output runs/train_vs_probe]``
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import yaml

from headkit.cli.datafiles import read_rows, write_rows
from headkit.cli.main import main

GOAL = 0.02


PREVIOUS = {"epochs": 10, "lr": 1e-3, "validation_fraction": 0}


def compare(corpus: str, limit: int | None, out: Path, previous: bool = False) -> dict:
    """Probe, then train with the defaults, on one split of ``packaged:<corpus>``."""
    rows = read_rows(f"packaged:{corpus}", limit)  # already shuffled (seed 0)
    n_test = len(rows) // 5
    folder = out / corpus
    write_rows(folder / "train.csv", rows[n_test:])
    write_rows(folder / "test.csv", rows[:n_test])
    probe = ["probe", "--model", "packaged:minilm", "--data", str(folder / "train.csv")]
    probe += ["--test-data", str(folder / "test.csv"), "--output", str(folder / "probe")]
    _run(probe)
    results = json.loads((folder / "probe" / "probe_results.json").read_text())
    best = max(results["rows"], key=lambda r: (r["val_accuracy"], -r["layer"]))
    config = {
        "model": "packaged:minilm",
        "heads": [
            {
                "name": "label",
                "layer_hook": best["layer"],
                "pred_for_sequence": True,
                "pooling": "mean",
                "output_bias": True,
            }
        ],
        "data": {"train": "train.csv", "label_columns": {"label": "label"}},
    }
    started = time.perf_counter()
    head = _train_and_score(folder, config, "head")
    seconds = time.perf_counter() - started
    found = {}
    if previous:
        found["previous_defaults"] = _train_and_score(
            folder, {**config, "training": PREVIOUS}, "head_previous"
        )
    return {
        **found,
        "corpus": corpus,
        "classes": len(results["classes"]),
        "n_train": len(rows) - n_test,
        "n_test": results["n_test"],
        "layer": best["layer"],
        "probe": best["accuracy"],
        "head": head,
        "gap": head - best["accuracy"],
        "met": abs(head - best["accuracy"]) <= GOAL,
        "train_and_eval_seconds": seconds,
    }


def _train_and_score(folder: Path, config: dict, name: str) -> float:
    """``headkit train`` from ``config`` into ``folder/name``, then its held-out accuracy."""
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    _run(["train", str(folder / f"{name}.yaml"), "--output", str(folder / name)])
    metrics = folder / f"{name}_metrics.json"
    _run(["eval", str(folder / name), "--data", str(folder / "test.csv"), "--output", str(metrics)])
    return json.loads(metrics.read_text())["label"]["accuracy"]


def _run(argv: list[str]) -> None:
    argv = [*argv, "--quiet", "--overwrite"]
    print("$ headkit " + " ".join(shlex.quote(a) for a in argv), flush=True)
    if main(argv) != 0:
        raise SystemExit(f"headkit {argv[0]} failed")


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reviews", type=int, default=4000, help="review snippets used (4000)")
    p.add_argument("--debates", type=int, default=None, help="debate sentences (all: 3,378)")
    p.add_argument("--previous", action="store_true", help="also train at the old defaults")
    p.add_argument("--output", default="runs/train_vs_probe")
    args = p.parse_args(argv)
    out = Path(args.output)
    found = [
        compare("rotten_tomatoes", args.reviews, out, args.previous),
        compare("presidential_debates", args.debates, out, args.previous),
    ]
    print(f"\n{'corpus':<22} classes  train  test  layer  probe  head   gap     within {GOAL}")
    for r in found:
        print(
            f"{r['corpus']:<22} {r['classes']:>7}  {r['n_train']:>5}  {r['n_test']:>4}  "
            f"{r['layer']:>5}  {r['probe']:.3f}  {r['head']:.3f}  {r['gap']:+.3f}  {r['met']}"
            + (f"  (previous defaults {r['previous_defaults']:.3f})" if args.previous else "")
        )
    (out / "results.json").write_text(json.dumps(found, indent=2) + "\n")
    return 0 if all(r["met"] for r in found) else 1


if __name__ == "__main__":
    sys.exit(cli())
