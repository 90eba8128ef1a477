"""``headkit demo``: the packaged MiniLM and review snippets, end to end, offline.

1. ``probe_layers`` over every layer (mean pooling, control task, a few validation splits);
2. a sentiment head on the layer picked on validation, trained through the same code as
   ``headkit train`` from a config and CSV files it writes (so they can be rerun by hand),
   on the probe's pooled features of that layer: the backbone runs over the texts once;
3. ``headkit predict`` on the held-out reviews.

Importing this module imports argparse only; ``run`` imports the rest.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .options import add_quiet, positive, val_splits

HELP = "probe the packaged MiniLM on the packaged reviews, then train a head"
EXAMPLE = """example:
  headkit demo                     # minutes on 2 CPU cores (17 min at load 10-15)
  headkit demo --examples 4000 --output runs/demo"""

LABELS = {0: "rotten", 1: "fresh"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--examples", type=positive, default=2000, help="reviews used (default 2000)")
    p.add_argument(
        "--val-splits",
        type=val_splits,
        default=3,
        help="random validation splits the probe averages over (default 3)",
    )
    p.add_argument("--output", default="runs/demo", help="default: runs/demo")
    add_quiet(p)


def run(args: argparse.Namespace) -> None:
    run_demo(
        args.examples,
        args.val_splits,
        Path(args.output),
        progress=not args.quiet,
        device=args.device,
    )


def run_demo(
    examples: int, val_splits: int, out: Path, progress: bool = True, device: str | None = None
) -> dict:
    """Run the demo, writing everything under ``out``; return the headline numbers."""
    import yaml

    from ..packaged import rotten_tomatoes
    from ..probe.sweep import probe_layers
    from .datafiles import read_rows, write_rows
    from .options import resolve_device
    from .outputs import check_output_folder
    from .predict import run_predict
    from .train import load_train_config, run_train

    check_output_folder(
        out,
        [],
        overwrite=True,  # the demo's own files, from an earlier run
        ours=lambda folder: (folder / "train.yaml").is_file(),
        what="an earlier headkit demo's output",
    )
    start = time.perf_counter()
    rows = rotten_tomatoes(limit=examples, seed=0)
    texts = [t for t, _ in rows]
    labels = [LABELS[y] for _, y in rows]
    print(
        f"headkit demo: {len(rows)} rotten-tomatoes review snippets (fresh or rotten) and the "
        "packaged all-MiniLM-L6-v2 (6 layers); nothing is downloaded\n"
    )
    print(
        f"[1/3] a linear probe per layer (mean pooling, {val_splits} validation splits, "
        "control task)"
    )
    where = resolve_device(device)
    results = probe_layers(
        "packaged:minilm",
        texts,
        labels,
        control=True,
        progress=progress,
        val_splits=val_splits,
        model_kwargs={"device_map": str(where)} if where.type != "cpu" else None,
        keep_features=True,  # the head trains on them: the backbone runs over the texts once
    )
    print(results.table())
    out.mkdir(parents=True, exist_ok=True)
    results.to_json(out / "probe_results.json")
    results.plot(out / "probe_results.png", title="all-MiniLM-L6-v2 on rotten-tomatoes reviews")
    best = results.best()

    print(f"\n[2/3] a sentiment head on layer {best.layer} (headkit train {out / 'train.yaml'})")
    held_out = set(results.test_index)
    training_rows = [i for i in range(len(texts)) if i not in held_out]
    table = [{"text": t, "label": y} for t, y in zip(texts, labels)]
    write_rows(out / "train.csv", [table[i] for i in training_rows])
    write_rows(out / "test.csv", [r for i, r in enumerate(table) if i in held_out])
    config = _train_config(best.layer)
    (out / "train.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    # the probe's mean-pooled features of that layer, one row per line of train.csv: the
    # same backbone, tokenization (max_length 128) and pooling as the head's, so training
    # needs no second backbone pass (headkit train train.yaml by hand runs one)
    pooled = results.features[(best.pooling, best.layer)][training_rows]
    trained = run_train(
        load_train_config(out / "train.yaml"),
        progress=progress,
        overwrite=True,
        device=device,
        features={"sentiment": pooled},
    )
    accuracy = trained["metrics"]["sentiment"]["accuracy"]

    print(f"\n[3/3] held-out predictions (headkit predict -> {out / 'predictions.csv'})")
    predictions = run_predict(
        out / "sentiment",
        str(out / "test.csv"),
        out / "predictions.csv",
        progress=progress,
        overwrite=True,
        device=device,
    )
    for r in read_rows(predictions, limit=3):
        print(f"  {r['sentiment']:<6} p={float(r['sentiment_prob']):.2f}  {r['text'][:70]}")

    spread = f" ± {best.std:.3f}" if best.std is not None else ""
    elapsed = time.perf_counter() - start
    print(
        f"\nheld-out accuracy on {results.n_test} reviews:\n"
        f"  majority-class baseline                 {results.baseline:.3f}\n"
        f"  probe on layer {best.layer} (picked on validation)   {best.score:.3f}{spread}"
        f"   (control task {best.control:.3f}, selectivity {best.selectivity:+.3f})\n"
        f"  sentiment head on layer {best.layer} (headkit train)  {accuracy:.3f}\n"
        f"wrote {out}/: probe_results.json/.png, train.yaml, train.csv, test.csv, sentiment/ "
        f"(checkpoint), predictions.csv; {elapsed:.0f} s in all"
    )
    return {"probe": best.score, "head": accuracy, "baseline": results.baseline, "seconds": elapsed}


def _train_config(layer: int) -> dict:
    """The demo's train config: a sentiment head on ``layer``, training at the defaults."""
    return {
        "model": "packaged:minilm",
        "heads": [
            {
                "name": "sentiment",
                "layer_hook": layer,
                "pred_for_sequence": True,
                "pooling": "mean",
                "output_bias": True,
            }
        ],
        "data": {
            "train": "train.csv",
            "eval": "test.csv",
            "text_column": "text",
            "label_columns": {"sentiment": "label"},
        },
        "training": {"batch_size": 32, "seed": 0},  # epochs, lr: the defaults
        "output": "sentiment",
    }
