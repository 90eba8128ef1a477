"""What do cached features save on a 10-epoch probe over a frozen backbone?

Both ways train the same head from the same start, with the same batch order, in one process:
  recompute  HeadedModel.forward every step (frozen backbone in eval mode, heads trained)
  cached     cache_features once (the backbone runs one pass), then train_heads_on_features
Setting: the packaged all-MiniLM-L6-v2, ~1000 rotten-tomatoes texts (max length 64), one
sequence head (mean pooling) on layer -1, batch 32, AdamW lr 1e-3, 10 epochs, 2 threads.

1. Equivalence: both ways run in full (10 recompute epochs, one cache pass and 10 cached
   epochs); their epoch losses and trained heads are compared. Their wall times ("measured
   totals", with the other processes' load) are kept in the details.
2. The figure, by the suite's harness (``_harness``: warm-up, the pieces alternated A B C,
   C B A, ..., medians, rerun when other processes loaded the machine), composed as scenario
   (f) of the suite is: recompute = epochs x batches x (one train step through the backbone);
   cached = batches x (cache_features over one batch) + (train_heads_on_features, all
   epochs). Goal: cached ÷ recompute <= 0.15. Each piece walks the same batches in order.

Run (writes benchmarks/results/cached_features.json and a report beside it, .md;
``--quick``: 16 texts, 2 epochs, a smoke test):
  HF_HUB_OFFLINE=1 python benchmarks/bench_cached_features.py
"""

from __future__ import annotations

import argparse
import copy
import itertools
import time
from pathlib import Path

import torch
from _harness import Goal, LoadMeter, add_measure_args, ensure_bench_env, settings_of
from _report import bench_result, figure, publish
from transformers import AutoModel, AutoTokenizer

from headkit import HeadConfig, HeadedModel, cache_features, train_heads_on_features
from headkit.packaged import minilm_path, rotten_tomatoes

HERE = Path(__file__).resolve().parent
NAME = "cached_features"
GOAL = Goal("<=", 0.15)


def make_data(n: int, max_length: int):
    tok = AutoTokenizer.from_pretrained(minilm_path())
    rows = []
    for text, label in rotten_tomatoes(limit=n):
        ids = tok(text, truncation=True, max_length=max_length)["input_ids"]
        rows.append({"input_ids": ids, "label": label})
    pad = tok.pad_token_id

    def collate(batch: list[dict]) -> dict:
        width = max(len(r["input_ids"]) for r in batch)
        ids = [r["input_ids"] + [pad] * (width - len(r["input_ids"])) for r in batch]
        mask = [[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in batch]
        return {
            "input_ids": torch.tensor(ids),
            "attention_mask": torch.tensor(mask),
            "label": torch.tensor([r["label"] for r in batch]),
        }

    return rows, collate


def recompute_epoch(model, opt, rows, collate, order, batch_size) -> float:
    """One epoch through HeadedModel.forward; the mean loss."""
    losses = []
    for s in range(0, len(rows), batch_size):
        out = model(**collate([rows[i] for i in order[s : s + batch_size]]))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    return sum(losses) / len(losses)


def equivalence(base, rows, collate, args) -> dict:
    """Both ways in full from the same start and batch order: losses, head differences, and
    their wall times with the load meanwhile."""
    recompute, cached = copy.deepcopy(base), copy.deepcopy(base)
    opt = torch.optim.AdamW([p for p in recompute.parameters() if p.requires_grad], lr=args.lr)
    g = torch.Generator().manual_seed(args.seed)  # the order train_heads_on_features visits
    orders = [torch.randperm(len(rows), generator=g).tolist() for _ in range(args.epochs)]
    torch.manual_seed(args.seed)  # the dropout seed train_heads_on_features sets
    with LoadMeter() as rec_load:
        rec_losses = [
            recompute_epoch(recompute, opt, rows, collate, o, args.batch_size) for o in orders
        ]
    with LoadMeter() as cache_load:
        feats = cache_features(cached, rows, args.batch_size, collate, progress=False)
        cached_losses = train_heads_on_features(
            cached,
            feats,
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed,
        )
    sa, sb = recompute.head_state_dict(), cached.head_state_dict()
    return {
        "final_loss_recompute": rec_losses[-1],
        "final_loss_cached": cached_losses[-1],
        "max_epoch_loss_diff": max(abs(a - b) for a, b in zip(rec_losses, cached_losses)),
        "max_head_param_diff": max(float((sa[k] - sb[k]).abs().max()) for k in sa),
        "measured_totals": {
            "recompute_s": round(rec_load.wall, 3),
            "cached_s": round(cache_load.wall, 3),
            "cached_over_recompute": round(cache_load.wall / rec_load.wall, 4),
            "other_cores": [round(rec_load.other_cores, 3), round(cache_load.other_cores, 3)],
        },
    }


def pieces(base, rows, collate, args) -> dict:
    """The three alternated pieces: a recompute train step, a cache pass over one batch, and
    the whole cached training (on features cached once beforehand)."""
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    cached = copy.deepcopy(base)
    feats = cache_features(cached, rows, args.batch_size, collate, progress=False)
    chunks = [rows[s : s + args.batch_size] for s in range(0, len(rows), args.batch_size)]
    step_batches, cache_batches = itertools.cycle(chunks), itertools.cycle(chunks)

    def step() -> None:
        out = model(**collate(next(step_batches)))
        opt.zero_grad()
        out.loss.backward()
        opt.step()

    def cache_batch() -> None:
        cache_features(cached, next(cache_batches), args.batch_size, collate, progress=False)

    def cached_training() -> None:
        train_heads_on_features(
            cached,
            feats,
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed,
        )

    return {"step": step, "cache_batch": cache_batch, "cached_training": cached_training}


def main(argv: list[str] | None = None) -> dict:
    """Measure; return (and write to --out, with a report beside it) the result."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_measure_args(ap)
    ap.add_argument("--texts", type=int, default=None, help="(1000; quick 16)")
    ap.add_argument("--max-length", type=int, default=None, help="(64; quick 16)")
    ap.add_argument("--epochs", type=int, default=None, help="(10; quick 2)")
    ap.add_argument("--batch-size", type=int, default=None, help="(32; quick 8)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=HERE / "results" / f"{NAME}.json")
    args = ap.parse_args(argv)
    st = settings_of(args)
    args.texts = args.texts or (16 if st.quick else 1000)
    args.epochs = args.epochs or (2 if st.quick else 10)
    args.max_length = args.max_length or (16 if st.quick else 64)
    args.batch_size = args.batch_size or (8 if st.quick else 32)
    torch.set_num_threads(st.threads)
    rows, collate = make_data(args.texts, args.max_length)
    head = HeadConfig(
        "sentiment", target="label", pred_for_sequence=True, num_outputs=2, pooling="mean"
    )
    torch.manual_seed(args.seed)
    base = HeadedModel(AutoModel.from_pretrained(minilm_path()), [head])
    base.backbone.eval()
    t0 = time.perf_counter()
    same = equivalence(base, rows, collate, args)
    print(f"equivalence: {time.perf_counter() - t0:.0f} s; {same['measured_totals']}", flush=True)
    t = st.measure(pieces(base, rows, collate, args))
    batches = -(-len(rows) // args.batch_size)
    recompute_s = args.epochs * batches * t.median["step"]
    cached_s = batches * t.median["cache_batch"] + t.median["cached_training"]
    figures = [
        figure(
            f"cached ÷ recompute, {args.epochs}-epoch probe (composed from alternated medians)",
            cached_s / recompute_s,
            "ratio",
            GOAL,
        ),
        figure(
            "largest head-parameter difference, cached vs recompute",
            same["max_head_param_diff"],
            "abs",
        ),
        figure(
            "largest epoch-loss difference, cached vs recompute", same["max_epoch_loss_diff"], "abs"
        ),
    ]
    details = {
        **t.summary(),
        "loads": t.loads,
        "batches": batches,
        "recompute_s": round(recompute_s, 3),
        "cache_pass_s": round(batches * t.median["cache_batch"], 3),
        "cached_training_s": round(t.median["cached_training"], 4),
        "cache_pass_over_epoch": round(t.median["cache_batch"] / t.median["step"], 4),
        **same,
    }
    setting = {
        **st.as_dict(),
        "backbone": "all-MiniLM-L6-v2 (packaged)",
        "texts": len(rows),
        "tokens": sum(len(r["input_ids"]) for r in rows),
        "max_length": args.max_length,
        "head": "sequence, mean pooling, layer -1, 2 classes, 1 Linear",
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
    }
    result = bench_result(NAME, figures, setting, details, threads=st.threads)
    return publish(result, args.out, report(result))


def report(r: dict) -> str:
    s, d = r["settings"], r["details"]
    totals = d["measured_totals"]
    ms = d["ms"]
    return "\n".join(
        [
            f"# Cached features vs recomputing the backbone ({s['epochs']}-epoch probe)",
            "",
            f"Command (repository root, {r['machine']['cores']} cores): `{r['command']}`",
            "",
            f"Setting: {s['backbone']}, {s['texts']} rotten-tomatoes texts ({s['tokens']} "
            f"tokens, max length {s['max_length']}), {s['head']}, batch {s['batch_size']}, "
            f"{s['epochs']} epochs, AdamW, {s['threads']} threads, torch "
            f"{r['machine']['torch']}, malloc env vars set: {s['malloc_env']}, OMP_WAIT_POLICY "
            f"{s['omp_wait_policy']}; {r['created']}.",
            "",
            "| piece (median of alternated steps) | ms |",
            "| --- | ---: |",
            f"| recompute: one train step through the frozen backbone | {ms['step']:.1f} |",
            f"| cached: cache_features over one batch | {ms['cache_batch']:.1f} |",
            f"| cached: train_heads_on_features, {s['epochs']} epochs | "
            f"{ms['cached_training']:.1f} |",
            "",
            f"Composed over {d['batches']} batches: recompute {d['recompute_s']:.1f} s, cached "
            f"{d['cache_pass_s']:.2f} s (cache pass) + {d['cached_training_s']:.2f} s "
            f"(training): **cached ÷ recompute = {r['figures'][0]['value']:.3f}** (goal "
            f"{r['figures'][0]['goal']}). A cache pass over a batch costs "
            f"{d['cache_pass_over_epoch']:.2f} of a train step on it. Other processes used "
            f"{d['other_cores']:.2f} cores meanwhile ({d['attempts']} attempt(s)).",
            "",
            f"Both ways run in full from the same start and batch order: final epoch loss "
            f"recompute {d['final_loss_recompute']:.6f}, cached {d['final_loss_cached']:.6f}; "
            f"largest per-epoch loss difference {d['max_epoch_loss_diff']:.2e}; largest "
            f"head-parameter difference {d['max_head_param_diff']:.2e}. Their wall times: "
            f"recompute {totals['recompute_s']:.1f} s, cached {totals['cached_s']:.1f} s "
            f"(ratio {totals['cached_over_recompute']:.3f}; load {totals['other_cores']} cores).",
            "",
        ]
    )


if __name__ == "__main__":
    ensure_bench_env()
    main()
