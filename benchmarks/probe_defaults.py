"""Does the probe's default layer pick come close to the best layer's held-out score?

For each packaged data set (rotten-tomatoes snippets: fresh/rotten; the 2016 debates: 9
speakers; the 2012 convention speeches: 2 parties), the packaged all-MiniLM-L6-v2, mean
pooling, every layer: the last 20% of the shuffled rows are the test split (given, as an
official test split is), and the layer is picked on the rest by each selection rule, for
several seeds (which draw the validation splits):

  default        ``probe_layers`` with no options: 5-fold cross-validation (stratified)
  5/10 folds, log-loss   the fold-averaged validation log-loss picks (lowest)
  1 split        ``val_splits=1``: one random 20% validation split (the old default)
  3 splits       ``val_splits=3``

``gap`` is the best layer's test score minus the picked layer's (0 = the best layer was
picked). The backbone runs once per data set; every rule and seed probes the same features,
through the same functions ``probe_layers`` calls.

Run: HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 python benchmarks/probe_defaults.py [--rows 8000]\
       [--data NAME ...] [--rules RULE ...]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from headkit.backbone.sources import load_model, resolve_model, source_tokenizer
from headkit.packaged import convention_speeches, presidential_debates, rotten_tomatoes
from headkit.probe.data import prepare_rows, split_rows
from headkit.probe.fit import DEFAULT_L2
from headkit.probe.sweep import _features, _score

RULES = {
    "default": {"folds": 5},
    "5 folds, log-loss": {"folds": 5, "select": "loss"},
    "10 folds, log-loss": {"folds": 10, "select": "loss"},
    "1 split": {"val_splits": 1},
    "3 splits": {"val_splits": 3},
}
DATASETS = {
    "rotten_tomatoes": rotten_tomatoes,
    "presidential_debates": presidential_debates,
    "convention_speeches": convention_speeches,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=3000, help="rows per data set (default 3000)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--output", default=None, help="write the results as JSON here")
    ap.add_argument("--data", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    ap.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    args = ap.parse_args()
    path, kwargs = resolve_model("packaged:minilm")
    backbone, tokenizer = load_model(path, kwargs), source_tokenizer(path)
    report = {}
    for name in args.data:
        rows = DATASETS[name](limit=args.rows)
        texts, labels = [t for t, _ in rows], [y for _, y in rows]
        n_test = round(0.2 * len(rows))
        n_train = len(rows) - n_test
        # the given test split last, as probe_layers(test_inputs=...) appends it
        texts = texts[n_test:] + texts[:n_test]
        labels = labels[n_test:] + labels[:n_test]
        started = time.perf_counter()
        prepared = prepare_rows(tokenizer, texts, labels, "classification", 128)
        layers = list(range(backbone.config.num_hidden_layers + 1))
        features = _features(backbone, prepared, layers, ["mean"], 32, False, 1)
        seconds = time.perf_counter() - started
        report[name] = {"rows": len(rows), "n_test": n_test, "backbone_seconds": seconds}
        for rule in args.rules:
            options = RULES[rule]
            gaps, picks, picked_tests = [], [], []
            for seed in range(args.seeds):
                folds = options.get("folds")
                val_splits = folds or options["val_splits"]
                split = split_rows(prepared, 0.2, 0.2, val_splits, seed, n_train, folds)
                select = options.get("select", "accuracy")
                _, _, scores = _score(
                    features,
                    prepared,
                    split,
                    False,
                    seed,
                    DEFAULT_L2,
                    200,
                    3e-4,
                    100,
                    False,
                    select,
                )
                key = "val_loss" if select == "loss" else "val"
                sign = -1.0 if select == "loss" else 1.0
                val = {k: sign * float(scores[("mean", k)][key][:, 0].mean()) for k in layers}
                test = {k: float(scores[("mean", k)]["score"][0]) for k in layers}
                pick = max(layers, key=lambda k: (val[k], -k))
                gaps.append(max(test.values()) - test[pick])
                picks.append(pick)
                picked_tests.append(test[pick])
            report[name][rule] = {
                "picked_layers": picks,
                "test_of_pick": [round(v, 4) for v in picked_tests],
                "last_seed_best_test": round(max(test.values()), 4),
                "last_seed_best_layer": max(layers, key=lambda k: test[k]),
                "gaps": [round(g, 4) for g in gaps],
                "max_gap": round(max(gaps), 4),
                "last_seed_test_by_layer": {k: round(v, 4) for k, v in test.items()},
            }
            print(name, rule, json.dumps(report[name][rule]), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
