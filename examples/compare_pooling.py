"""Which pooling? A linear probe per (model, pooling strategy, layer) on rotten-tomatoes.

For the packaged all-MiniLM-L6-v2 encoder and SmolLM2-135M decoder, ``headkit.probe_layers``
runs each frozen backbone once per batch and caches every layer pooled every way, then trains
all the logistic-regression probes together: L2 chosen on a validation fifth of the training
rows, held-out accuracy with a 95% bootstrap interval (see docs/probing.md).

Writes docs/pooling_comparison.csv and docs/pooling_comparison.png; results: docs/pooling.md.
Run: ``HF_HUB_OFFLINE=1 python examples/compare_pooling.py`` (everything is local).
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch

from headkit import probe_layers
from headkit.packaged import rotten_tomatoes

ROOT = Path(__file__).resolve().parent.parent
POOLINGS = ["first", "last", "mean", "max", "mean_sqrt_len", "weighted_mean"]  # no parameters
MODELS = {  # key: (model, title, train texts, test texts, extra poolings)
    "minilm": ("packaged:minilm", "all-MiniLM-L6-v2 (encoder, 6 layers)", 2000, 1000, ["pooler"]),
    "smollm2": ("packaged:smollm2", "SmolLM2-135M (decoder, 30 layers)", 1200, 600, []),
}


def run_model(key: str, args: argparse.Namespace):
    """Probe every (pooling, layer) of one packaged backbone; returns its ProbeResults."""
    model, title, n_train, n_test, extra = MODELS[key]
    n_train = getattr(args, f"{key}_train") or n_train
    n_test = getattr(args, f"{key}_test") or n_test
    rows = rotten_tomatoes(limit=n_train + n_test, seed=args.seed)
    start = time.perf_counter()
    results = probe_layers(
        model,
        [t for t, _ in rows],
        [y for _, y in rows],
        layers=args.layers,
        pooling=POOLINGS + extra,
        test_fraction=n_test / (n_train + n_test),
        val_splits=args.val_splits,
        seed=args.seed,
        max_length=args.max_length,
    )
    t = results.timings
    print(
        f"[{key}] {n_train} train / {n_test} test texts in {time.perf_counter() - start:.0f} s "
        f"(load {t['load']:.0f} s, backbone + pooling {t['features']:.0f} s, probes "
        f"{t['probes']:.1f} s); majority class {results.baseline:.3f}",
        flush=True,
    )
    return results


def summary_table(all_results: dict) -> str:
    """Markdown, per model and pooling: the layer with the best validation accuracy (ties: the
    shallower) and its test accuracy, the best test accuracy of any layer (optimistic: picked
    on the test rows), and the test accuracy at the last layer."""
    lines = [
        "| model | strategy | layer (picked on val) | test acc there [95% CI] "
        "| best test acc (layer) | test acc at last layer |",
        "|---|---|---|---|---|---|",
    ]
    for key, res in all_results.items():
        ranked = []
        for pooling in res.poolings:
            mine = [r for r in res.rows if r.pooling == pooling]
            picked = max(mine, key=lambda r: (r.val_score, -r.layer))
            best = max(mine, key=lambda r: (r.score, -r.layer))
            last = max(mine, key=lambda r: r.layer)
            ranked.append((picked, best, last))
        for picked, best, last in sorted(ranked, key=lambda t: -t[0].score):
            lines.append(
                f"| {key} | {picked.pooling} | {picked.layer} | {picked.score:.3f} "
                f"[{picked.ci95[0]:.3f}, {picked.ci95[1]:.3f}] | {best.score:.3f} ({best.layer}) "
                f"| {last.score:.3f} |"
            )
        lines.append(f"| {key} | majority class | - | {res.baseline:.3f} | - | - |")
    return "\n".join(lines)


def write_csv(all_results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = ["model", "strategy", "layer", "accuracy", "ci95_low", "ci95_high", "val_accuracy"]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(fields + ["l2"])
        for key, res in all_results.items():
            for r in res.rows:
                scores = [r.score, *r.ci95, r.val_score]
                l2 = "/".join(f"{v:g}" for v in r.l2)
                writer.writerow([key, r.pooling, r.layer, *(f"{v:.4f}" for v in scores), l2])


def plot(all_results: dict, path: Path) -> None:
    """Accuracy vs layer, one line per pooling, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(all_results), figsize=(6.5 * len(all_results), 4.5))
    axes = [axes] if len(all_results) == 1 else list(axes)
    for ax, (key, res) in zip(axes, all_results.items()):
        res.plot(ax=ax, title=MODELS[key][1])
    fig.suptitle("Linear probe on rotten-tomatoes: pooling strategy x layer (95% CI)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    for key in MODELS:
        ap.add_argument(f"--{key}-train", type=int, default=0, help="texts (0: the default)")
        ap.add_argument(f"--{key}-test", type=int, default=0, help="texts (0: the default)")
    ap.add_argument("--layers", default="all", help="all, 0,3,6 or -4: (hidden_states indices)")
    ap.add_argument("--val-splits", type=int, default=1, help="validation splits to average")
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--csv", type=Path, default=ROOT / "docs" / "pooling_comparison.csv")
    ap.add_argument("--png", type=Path, default=ROOT / "docs" / "pooling_comparison.png")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison; write the CSV and the plot; return ProbeResults by model."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    all_results = {key: run_model(key, args) for key in args.models}
    write_csv(all_results, args.csv)
    plot(all_results, args.png)
    print(summary_table(all_results))
    print(f"wrote {args.csv} and {args.png} in {time.perf_counter() - start:.0f} s", flush=True)
    return all_results


if __name__ == "__main__":
    main()
