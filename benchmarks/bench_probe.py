"""What does a layer sweep cost over one forward pass, and does it match the usual recipe?

Setting: the packaged all-MiniLM-L6-v2 (6 layers, so 7 hidden states), ``--texts``
rotten-tomatoes review snippets (max length 128), 2 threads, one process.

  sweep     ``probe_layers(model, texts, labels)`` with its defaults: every layer, mean
            pooling, 5-fold cross-validation (L2 chosen from 5 values), the probe refitted
            on every training example, bootstrap interval; the model is already loaded,
            so tokenizing, the cached backbone pass and the probes are timed
  forward   tokenize the same texts and run the bare model once over them, in the same
            batches (the sweep sorts texts by length; so does this), keeping nothing
  recipe    the usual hand-written study: the bare model with ``output_hidden_states=True``,
            masked mean pooling of every hidden state, then scikit-learn
            ``StandardScaler`` + ``LogisticRegression()`` (defaults: C=1, lbfgs) per layer,
            trained on the sweep's whole training split and scored on its held-out split

Timed by the suite's harness (``_harness``: the sides alternated A B, B A, ..., medians,
rerun when other processes loaded the machine) after a warm-up of both on 256 texts (none
with --quick): sweep and forward ``--repeats`` times (goal: sweep / forward <= 1.2, wall
time; the CPU-time ratio beside it), the full sweep (3 validation splits, control task) and forward
twice, the recipe and the sweep once. Accuracies: the sweep against the recipe (defaults),
and the sweep with sklearn's regularisation against sklearn on the same rows (matched: two
optimisers, one problem).

Run (writes benchmarks/results/probe.json and a report beside it, .md; ``--quick``: 32 texts,
fewer bootstrap samples and iterations, a smoke test):
  HF_HUB_OFFLINE=1 python benchmarks/bench_probe.py
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from _harness import Goal, add_measure_args, ensure_bench_env, settings_of
from _report import bench_result, figure, publish
from transformers import AutoModel, AutoTokenizer

from headkit import probe_layers
from headkit.packaged import minilm_path, rotten_tomatoes

HERE = Path(__file__).resolve().parent
NAME = "probe"
GOAL = Goal("<=", 1.2)


def batches(tok, texts: list[str], batch_size: int, max_length: int):
    """Padded batches in the sweep's order (sorted by tokenized length)."""
    ids = tok(texts, truncation=True, max_length=max_length)["input_ids"]
    order = sorted(range(len(texts)), key=lambda i: len(ids[i]))
    for s in range(0, len(order), batch_size):
        chunk = order[s : s + batch_size]
        enc = tok(
            [texts[i] for i in chunk],
            truncation=True,
            max_length=max_length,
            padding=True,
            return_tensors="pt",
        )
        yield chunk, enc


def plain_forward(model, tok, texts, batch_size, max_length) -> None:
    with torch.inference_mode():
        for _, enc in batches(tok, texts, batch_size, max_length):
            model(**enc)


def recipe_features(model, tok, texts, batch_size, max_length):
    """The usual recipe's features: (layers, texts, hidden) masked means of every state."""
    import numpy as np

    feats = None
    with torch.inference_mode():
        for chunk, enc in batches(tok, texts, batch_size, max_length):
            states = model(**enc, output_hidden_states=True).hidden_states
            mask = enc["attention_mask"].unsqueeze(-1).float()
            pooled = torch.stack([(h * mask).sum(1) / mask.sum(1) for h in states])
            if feats is None:
                feats = np.zeros((len(states), len(texts), pooled.shape[-1]), dtype=np.float32)
            feats[:, chunk] = pooled.numpy()
    return feats


def recipe_accuracy(feats, labels, test_index) -> list[float]:
    """As users write it: StandardScaler + LogisticRegression() (C=1) per layer, trained on
    the whole training split, scored on the held-out split."""
    import numpy as np
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    test = np.zeros(feats.shape[1], dtype=bool)
    test[test_index] = True
    y = np.array(labels)
    accs = []
    for layer in range(feats.shape[0]):
        clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))
        clf.fit(feats[layer][~test], y[~test])
        accs.append(float(clf.score(feats[layer][test], y[test])))
    return accs


def matched_accuracy(feats, labels, test_index, fit_index) -> list[float]:
    """sklearn's C=1 trained on the sweep's fit rows only, with the scaler fitted on the
    training split as the sweep does, solved to sklearn's precision: to compare optimisers."""
    import numpy as np
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    test = np.zeros(feats.shape[1], dtype=bool)
    test[test_index] = True
    y = np.array(labels)
    out = []
    for layer in range(feats.shape[0]):
        scaler = StandardScaler().fit(feats[layer][~test])
        clf = LogisticRegression(C=1.0, tol=1e-8, max_iter=10_000)
        clf.fit(scaler.transform(feats[layer][fit_index]), y[fit_index])
        out.append(float(clf.score(scaler.transform(feats[layer][test]), y[test])))
    return out


def fit_rows(tok, texts, labels, max_length: int) -> list[int]:
    """The examples the sweep's scored probe trains on: every training example (the probe is
    refitted on all of them after cross-validation; the held-out split, recomputed)."""
    from headkit.probe.data import prepare_rows, split_rows

    rows = prepare_rows(tok, texts, labels, "classification", max_length)
    split = split_rows(rows, 0.2, 0.2, 1, 0)
    return rows.example[split["train"]].tolist()


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_measure_args(ap)
    ap.add_argument("--texts", type=int, default=None, help="(2000; quick 32)")
    ap.add_argument("--repeats", type=int, default=None, help="timed sweeps and forwards (5)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=None, help="(128; quick 16)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / f"{NAME}.json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Measure; return (and write to --out, with a report beside it) the result."""
    args = parse_args(argv)
    st = settings_of(args)
    n_texts = args.texts or (32 if st.quick else 2000)
    repeats = args.repeats or (1 if st.quick else 5)
    args.max_length = args.max_length or (16 if st.quick else 128)
    torch.set_num_threads(st.threads)
    rows = rotten_tomatoes(limit=n_texts, seed=0)
    texts, labels = [t for t, _ in rows], [y for _, y in rows]
    path = str(minilm_path())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    common = dict(
        tokenizer=tok, batch_size=args.batch_size, max_length=args.max_length, progress=False
    )
    if st.quick:  # a smoke test: the probes' fit need not converge
        common.update(bootstrap=50, max_iter=20)
    held: dict = {}

    def sweep(key: str = "sweep", **extra):
        kw = {**common, **extra}
        return lambda: held.update({key: probe_layers(model, texts, labels, **kw)})

    def forward():
        plain_forward(model, tok, texts, args.batch_size, args.max_length)

    if not st.quick:  # warm-up: kernels and allocator, both sides, on a part of the texts
        probe_layers(model, texts[:256], labels[:256], **common)
        plain_forward(model, tok, texts[:256], args.batch_size, args.max_length)
    t = st.measure({"sweep": sweep(), "forward": forward}, warmup=0, steps=repeats)
    result = held["sweep"]
    full_t = st.measure(
        {"full_sweep": sweep(key="full", control=True, val_splits=3), "forward": forward},
        warmup=0,
        steps=1 if st.quick else 2,
    )
    recipe: dict = {}

    def usual_recipe() -> None:
        recipe["states"] = recipe_features(model, tok, texts, args.batch_size, args.max_length)
        recipe["accuracy"] = recipe_accuracy(recipe["states"], labels, result.test_index)

    recipe_t = st.measure({"recipe": usual_recipe, "sweep": sweep()}, warmup=0, steps=1)
    fit_index = fit_rows(tok, texts, labels, args.max_length)
    # the sweep with sklearn's C=1 (mean loss + |u|^2 / (2 n_fit)) on the same fit rows
    # solved to sklearn's precision (its tol=1e-8): the same convex problem, both converged
    matched_iter = common.get("max_iter", 5000) if st.quick else 5000
    sweep(key="matched", l2=[1.0 / len(fit_index)], max_iter=matched_iter, tol=1e-7)()
    accuracy = {
        "sweep": [result.row(k).score for k in result.layers],
        "recipe": recipe["accuracy"],
        "matched_sweep": [held["matched"].row(k).score for k in held["matched"].layers],
        "matched_recipe": matched_accuracy(recipe["states"], labels, result.test_index, fit_index),
    }
    out = _result(args, st, texts, tok, t, full_t, recipe_t, result, held["full"], accuracy)
    return publish(out, args.out, _markdown(out))


def _result(args, st, texts, tok, t, full_t, recipe_t, result, full, acc) -> dict:
    diffs = [a - b for a, b in zip(acc["sweep"], acc["recipe"])]
    matched = [a - b for a, b in zip(acc["matched_sweep"], acc["matched_recipe"])]
    best_sweep = result.best()
    best_recipe = max(range(len(acc["recipe"])), key=lambda i: acc["recipe"][i])
    figures = [
        figure(
            "layer sweep (probe_layers defaults) ÷ one forward pass",
            t.ratio("sweep", "forward"),
            "ratio",
            GOAL,
        ),
        figure(
            "layer sweep ÷ one forward pass, CPU time", t.cpu_ratio("sweep", "forward"), "ratio"
        ),
        figure(
            "sweep with 3 validation splits and the control task ÷ one forward pass",
            full_t.ratio("full_sweep", "forward"),
            "ratio",
        ),
        figure(
            "usual recipe (output_hidden_states + sklearn) ÷ layer sweep",
            recipe_t.ratio("recipe", "sweep"),
            "ratio",
        ),
        figure(
            "largest |accuracy difference|, sweep vs usual recipe (defaults)",
            max(abs(d) for d in diffs),
            "abs",
        ),
        figure(
            "largest |accuracy difference|, matched regularisation",
            max(abs(d) for d in matched),
            "abs",
        ),
    ]
    details = {
        "timing": t.summary(),
        "full_sweep_timing": full_t.summary(),
        "recipe_timing": recipe_t.summary(),
        "sweep_phases_last": result.timings,
        "accuracy": acc,
        "accuracy_diff": diffs,
        "mean_abs_accuracy_diff": statistics.mean(abs(d) for d in diffs),
        "matched_accuracy_diff": matched,
        "sweep_best": {"layer": best_sweep.layer, "accuracy": best_sweep.score},
        "recipe_best": {"layer": best_recipe, "accuracy": acc["recipe"][best_recipe]},
        "full_sweep": {
            "accuracy": [full.row(k).score for k in full.layers],
            "std": [full.row(k).std for k in full.layers],
            "selectivity": [full.row(k).selectivity for k in full.layers],
        },
        "baseline": result.baseline,
        "n_train": result.n_train,
        "n_test": result.n_test,
    }
    setting = {
        **st.as_dict(),
        "backbone": "all-MiniLM-L6-v2 (packaged), 7 hidden states",
        "texts": len(texts),
        "tokens": sum(
            len(x) for x in tok(texts, truncation=True, max_length=args.max_length)["input_ids"]
        ),
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "repeats": t.summary()["steps"],
    }
    return bench_result(NAME, figures, setting, details, threads=st.threads)


def _markdown(r: dict) -> str:
    s, d, acc = r["settings"], r["details"], r["details"]["accuracy"]
    fig = {f["name"]: f["value"] for f in r["figures"]}
    ms = {**d["timing"]["ms"], **d["full_sweep_timing"]["ms"], **d["recipe_timing"]["ms"]}
    names = [f["name"] for f in r["figures"]]
    lines = [
        "# Layer sweep vs one forward pass, and vs the usual recipe",
        "",
        f"Command (repository root, {r['machine']['cores']} cores): `{r['command']}`",
        "",
        f"Setting: {s['backbone']}, {s['texts']} rotten-tomatoes snippets ({s['tokens']} "
        f"tokens, max length {s['max_length']}), batch {s['batch_size']}, {s['threads']} "
        f"threads, torch {r['machine']['torch']}, malloc env vars set: {s['malloc_env']}, "
        f"OMP_WAIT_POLICY {s['omp_wait_policy']}; {r['created']}. Held-out split of the "
        f"sweep: {d['n_train']} train / {d['n_test']} test, used by both sides.",
        "",
        "| median of alternated runs | wall time (s) |",
        "| --- | ---: |",
        "| one plain forward pass of the bare model (tokenize + forward), "
        f"{s['repeats']} runs | {ms['forward'] / 1e3:.2f} |",
        "| `probe_layers` defaults: all 7 layers, mean pooling, 1 seed, 5 L2 values, "
        f"{s['repeats']} runs | {d['timing']['ms']['sweep'] / 1e3:.2f} |",
        f"| `probe_layers(..., val_splits=3, control=True)`, {d['full_sweep_timing']['steps']} "
        f"runs | {ms['full_sweep'] / 1e3:.2f} |",
        "| usual recipe: output_hidden_states + sklearn LogisticRegression per layer, 1 run "
        f"| {ms['recipe'] / 1e3:.2f} |",
        "",
        f"**sweep / forward = {fig[names[0]]:.2f}** in wall time (goal {r['figures'][0]['goal']}), "
        f"{fig[names[1]]:.2f} in this process's CPU time; with 3 validation splits and the control "
        f"task {fig[names[2]]:.2f}; usual recipe / sweep = {fig[names[3]]:.2f}. Other processes "
        f"used {d['timing']['other_cores']:.2f} cores during the sweep/forward timing. Phases "
        "of the last sweep (s): "
        + ", ".join(f"{k} {v:.2f}" for k, v in d["sweep_phases_last"].items())
        + ".",
        "",
        "Held-out accuracy per layer (0 = embeddings). *Default*: the sweep with its defaults "
        "(L2 chosen on validation, trained on 80% of the training split) against the usual "
        "recipe (C=1, the whole training split). *Matched*: the sweep with sklearn's "
        "regularisation (`l2=[1 / n_fit]`, i.e. C=1) against sklearn's `LogisticRegression(C=1)` "
        "on the same fit rows and standardisation: the same problem, two optimisers.",
        "",
        "| layer | sweep (default) | usual recipe | difference | sweep (matched) "
        "| sklearn (matched) | difference |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    rows = zip(acc["sweep"], acc["recipe"], acc["matched_sweep"], acc["matched_recipe"])
    for k, (a, b, c, e) in enumerate(rows):
        lines.append(
            f"| {k} | {a:.4f} | {b:.4f} | {a - b:+.4f} | {c:.4f} | {e:.4f} | {c - e:+.4f} |"
        )
    lines += [
        "",
        f"Default: mean |difference| {d['mean_abs_accuracy_diff']:.4f}, largest "
        f"{fig[names[4]]:.4f}. Matched: largest |difference| {fig[names[5]]:.4f}. Best layer: "
        f"sweep (picked on validation) layer {d['sweep_best']['layer']} at "
        f"{d['sweep_best']['accuracy']:.4f}; recipe (picked on the test split) layer "
        f"{d['recipe_best']['layer']} at {d['recipe_best']['accuracy']:.4f}. Majority-class "
        f"baseline {d['baseline']:.4f} (one held-out text is {1 / d['n_test']:.4f} of accuracy).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    ensure_bench_env()
    main()
