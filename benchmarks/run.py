"""headkit's benchmark suite: one command, every figure a ratio against the floor or the peer.

    make bench                                  # the whole suite + other benchmarks
    python benchmarks/run.py                    # the suite (a-i) on GPT-2, Llama, BERT
    python benchmarks/run.py --quick --only a,b # a smoke run on tiny models
    python benchmarks/run.py --device cuda --dtype bfloat16 --layers 24 --hidden 1024

Writes ``benchmarks/results.json`` and ``docs/benchmarks.md``; exits non-zero only when a
scenario or another benchmark broke (a missed goal is a result, not an error). The malloc
settings of shared BENCHMARKING.md and OMP_WAIT_POLICY=PASSIVE are applied by re-executing
itself when they are missing.
Scenarios: see ``benchmarks/_suite.py`` and ``benchmarks/README.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (  # noqa: E402  (stdlib only: cheap before re-exec)
    add_measure_args,
    ensure_bench_env,
    settings_of,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def parse_args(argv: list[str] | None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_measure_args(ap)  # --quick, --threads, --warmup, --steps, --max-load, ...
    ap.add_argument("--only", default="abcdefghi", help="scenario letters, e.g. a,b,e")
    ap.add_argument(
        "--arch",
        default=None,
        help="gpt2,llama,bert (default: all three; compile (i) runs on gpt2 unless given)",
    )
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument(
        "--with-others",
        action="store_true",
        help="also run benchmarks/bench_*.py (with --quick: their quick runs); each writes "
        "its result beside --out, in results/<name>.json",
    )
    ap.add_argument("--out", type=Path, default=HERE / "results.json")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep the records of --out for the scenarios and archs not run now",
    )
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--note", default="", help="a line shown at the top of the doc")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import json
    import time

    import torch
    from _models import ARCHS, Sizes
    from _report import collect_others, command_line, machine_facts, write
    from _suite import SCENARIOS, Context, run_scenario

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    only = [c for c in args.only.replace(",", "") if c.strip()]
    bad = [c for c in only if c not in SCENARIOS]
    archs = args.arch.split(",") if args.arch else list(ARCHS)
    bad += [a for a in archs if a not in ARCHS]
    if bad:
        print(f"error: unknown scenario/arch {bad}; scenarios {SCENARIOS}, archs {ARCHS}")
        return 2
    base = (
        Sizes(layers=2, hidden=64, batch=2, seq=16, mem_batch=4, mem_seq=32)
        if args.quick
        else Sizes()
    )
    sizes = Sizes(
        layers=args.layers or base.layers,
        hidden=args.hidden or base.hidden,
        batch=args.batch or base.batch,
        seq=args.seq or base.seq,
        mem_batch=base.mem_batch,
        mem_seq=base.mem_seq,
    )
    q, st = args.quick, settings_of(args)
    ctx = Context(
        sizes=sizes,
        warmup=st.warmup,
        steps=st.steps,
        max_load=st.max_load,
        retries=st.retries,
        device=args.device,
        dtype=args.dtype,
        threads=st.threads,
        cached_batches=1 if q else 8,
        mem_repeats=1 if q else 3,
        quiet_timeout=st.quiet_timeout,
    )
    t0 = time.perf_counter()
    order = {c: i for i, c in enumerate(SCENARIOS)}
    kept: list[dict] = []
    commands = [command_line()]
    if args.merge and args.out.exists():  # earlier records of what is not run now
        todo = {(c, a) for c in only for a in (["gpt2"] if c == "i" and not args.arch else archs)}
        old = json.loads(args.out.read_text())
        kept = [r for r in old.get("records", []) if (r["scenario"], r["arch"]) not in todo]
        commands = old.get("commands", [old.get("command")]) + commands

    def assemble(records: list[dict], others: list[dict], errors: list[str]) -> dict:
        return {
            "suite": "headkit benchmarks (issue 13)",
            "format_version": 1,
            "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": commands[-1],
            "commands": commands,  # with --merge: every run whose records are kept
            "note": args.note,
            "machine": machine_facts(args.threads, args.device),
            "settings": {
                **ctx.sizes.__dict__,
                "archs": archs,
                "dtype": args.dtype,
                "warmup": ctx.warmup,
                "steps": ctx.steps,
                "max_load": ctx.max_load,
                "retries": ctx.retries,
                "quick": q,
                "wall_s": round(time.perf_counter() - t0, 1),
            },
            "records": sorted(kept + records, key=lambda r: order[r["scenario"]]),
            "others": others,
            "errors": errors,
        }

    records: list[dict] = []
    for letter in only:
        # compile time is large on a small CPU: (i) on GPT-2 unless archs were named
        for arch in ["gpt2"] if letter == "i" and not args.arch else archs:
            t = time.perf_counter()
            got = run_scenario(ctx, letter, arch)
            for r in got:
                r["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
            records += got
            for r in got:
                print(
                    f"[{time.perf_counter() - t0:6.0f}s] {r['name']:24s} {arch:6s} "
                    f"ratio={r['ratio']} goal={r['goal']} met={r['met']} {r['status']} "
                    f"{r['note'][:120]} ({time.perf_counter() - t:.0f}s)",
                    flush=True,
                )
            # after every scenario, so an interrupted run keeps what it measured (--merge)
            write({**assemble(records, [], []), "partial": True}, args.out, None)
    argv = ["--threads", str(args.threads)] + (["--quick"] if q else [])
    others, other_errors = collect_others(HERE, args.with_others, argv, args.out.parent / "results")
    errors = [f"{r['name']} ({r['arch']}): {r['note']}" for r in records if r["status"] == "error"]
    errors += other_errors
    results = assemble(records, others, errors)
    write(results, args.out, None if args.no_doc else args.doc)
    print(f"wrote {args.out}" + ("" if args.no_doc else f" and {args.doc}"))
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    ensure_bench_env()
    sys.exit(main())
