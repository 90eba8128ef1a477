"""Peak memory of the first train steps of a linear probe on a frozen backbone.

A tiny random 12-layer GPT-2 and Llama (hidden 256, built from configs, as the suite's
models), batch 8 x 128 (every token real), frozen backbone, one linear probe trained by
AdamW. Each scenario runs in a fresh process with the malloc settings of shared
BENCHMARKING.md: it builds the model, the probe and the optimizer, resets the kernel's
peak counter (VmHWM, ``/proc/self/clear_refs``), then runs ``--steps`` train steps
(forward, loss, backward, AdamW step). The figure is the peak RSS above the RSS before the
first step (MiB), the median over ``--repeats`` processes, the scenarios alternated:

  bare      the HF model (``use_cache=False``) + an ``nn.Linear(hidden, 1)`` on
            ``last_hidden_state``, MSE: the floor (no headkit imported)
  token     HeadedModel, a token regression probe (1 output, MSE) on layer L/2 (early exit)
  sequence  HeadedModel, a sequence probe (mean pooling, 2-class CE) on the last layer

RSS also holds what the allocator keeps beyond the live tensors, and it varies between fresh
processes of one commit by up to 2x (GPT-2: 42-87 MiB); so each process then runs one more
step under tracemalloc (peak of Python objects) and one under the profiler (peak of live
tensors above those alive before it): both repeatable to the byte. Goals, ratios of the
medians: RSS <= 1.2x the floor's; live tensors <= 1.1x the floor's. With ``--compare PATH``
the same scenarios also run with the headkit of another checkout (its folder first on
PYTHONPATH, e.g. ``git worktree add /tmp/old 4bb8382``), alternated with this one, and the
figures add this headkit ÷ that one (live tensors: goal <= 1.05; RSS: no goal, it is noise
at this size). ``--quick`` runs this headkit's scenarios in this process on tiny sizes (a
smoke test of the script, not a measurement).

Run (writes benchmarks/results/memory.json):
  HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/bench_memory.py --compare /tmp/old
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from _harness import (
    MALLOC_ENV,
    Goal,
    add_measure_args,
    ensure_bench_env,
    reset_peak_rss,
    settings_of,
    status_kib,
)
from _report import bench_result, figure, write_result

HERE = Path(__file__).resolve().parent
NAME = "memory"
ARCHS = ("gpt2", "llama")
KINDS = ("bare", "token", "sequence")
#: RSS of the first steps (noisy between processes: see the min-max in the details), and
#: the live tensors of a step (exact): a probe costs about what the floor costs.
FLOOR_GOAL, TENSOR_GOAL, COMPARE_GOAL = Goal("<=", 1.2), Goal("<=", 1.1), Goal("<=", 1.05)
SIZES = {"layers": 12, "hidden": 256, "batch": 8, "seq": 128}
QUICK_SIZES = {"layers": 2, "hidden": 64, "batch": 2, "seq": 16}


def _status_mib() -> dict[str, float]:
    """VmRSS, VmHWM, RssAnon and RssFile of this process (MiB)."""
    keys = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    return {k: (status_kib(k) or 0) / 1024 for k in keys}


def train_step(spec: dict[str, Any]):
    """Build the scenario of ``spec`` and return its train step (forward, loss, backward,
    AdamW step)."""
    import torch
    import torch.nn.functional as F
    from _models import Sizes, build, call_kwargs, token_ids
    from torch import nn

    torch.set_num_threads(spec["threads"])
    sizes = Sizes(**spec["sizes"])
    base = build(spec["arch"], sizes)
    ids = token_ids(sizes.batch, sizes.seq)
    mask = torch.ones_like(ids)
    y = torch.randn(sizes.batch, sizes.seq, generator=torch.Generator().manual_seed(3))
    cls = torch.randint(0, 2, (sizes.batch,), generator=torch.Generator().manual_seed(4))
    if spec["kind"] == "bare":
        base.requires_grad_(False)  # frozen, in eval mode (build), as HeadedModel leaves it
        linear = nn.Linear(sizes.hidden, 1)
        kw = call_kwargs(base)
        params = list(linear.parameters())

        def loss() -> torch.Tensor:
            h = base(input_ids=ids, attention_mask=mask, **kw).last_hidden_state
            return F.mse_loss(linear(h).squeeze(-1), y)

    else:
        from headkit import HeadConfig, HeadedModel

        if spec["kind"] == "token":
            head = HeadConfig(
                "probe",
                layer_hook=sizes.layers // 2,
                num_outputs=1,
                is_regression=True,
                loss_fct="mse",
                target="y",
            )
            batch = {"input_ids": ids, "attention_mask": mask, "y": y}
        else:
            head = HeadConfig(
                "probe", layer_hook=-1, num_outputs=2, pred_for_sequence=True, pooling="mean"
            )
            batch = {"input_ids": ids, "attention_mask": mask, "probe": cls}
        model = HeadedModel(base, [head], freeze_base_model=True).train()
        params = [p for p in model.parameters() if p.requires_grad]

        def loss() -> torch.Tensor:
            return model(**batch).loss

    opt = torch.optim.AdamW(params, lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss().backward()
        opt.step()

    return step


def live_tensor_peak(step) -> float | None:
    """Peak of live CPU tensor memory during one ``step`` above the tensors alive before it
    (MiB), from the profiler's memory timeline: exact and repeatable, unlike RSS, which
    also holds the allocator's fragmentation. None where the profiler cannot tell."""
    try:
        from torch.profiler import ProfilerActivity, profile
        from torch.profiler._memory_profiler import Action

        with profile(
            activities=[ProfilerActivity.CPU],
            profile_memory=True,
            record_shapes=True,
            with_stack=True,
        ) as prof:
            step()
        base = live = peak = 0
        for _, action, (key, _), size in prof._memory_profile().timeline:
            if key.device.type != "cpu":
                continue
            if action == Action.PREEXISTING:
                base += size
                live += size
            elif action == Action.CREATE:
                live += size
            elif action == Action.DESTROY:
                live -= size
            peak = max(peak, live)
        return round((peak - base) / 2**20, 2)
    except Exception as e:  # a private profiler API: report, do not fail the measurement
        print(f"live tensor peak unavailable: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def python_peak(step) -> float:
    """Peak of Python-object memory during one ``step`` above that before it (MiB)."""
    import tracemalloc

    tracemalloc.start()
    try:
        step()
        return round(tracemalloc.get_traced_memory()[1] / 2**20, 3)
    finally:
        tracemalloc.stop()


def measure_scenario(spec: dict[str, Any]) -> dict[str, Any]:
    """Peak RSS of the first ``spec["steps"]`` train steps above the RSS before them (MiB),
    the first step's alone, what was added to anonymous and file-backed memory by the end,
    the modules the steps imported; then, on one more step each, the peaks of Python
    objects and of live tensors (both repeatable, where RSS is not)."""
    step = train_step(spec)
    modules = set(sys.modules)
    gc.collect()
    reset = reset_peak_rss()
    before = _status_mib()
    step()
    first = _status_mib()["VmHWM"]
    for _ in range(spec["steps"] - 1):
        step()
    after = _status_mib()
    imported = sorted(set(sys.modules) - modules)
    python_mib, tensors_mib = python_peak(step), live_tensor_peak(step)  # after the RSS part
    headkit = sys.modules.get("headkit")
    return {
        "headkit": str(Path(headkit.__file__).parent.parent) if headkit else None,
        "increment_mib": round(after["VmHWM"] - before["VmRSS"], 1),
        "first_step_mib": round(first - before["VmRSS"], 1),
        "anon_added_mib": round(after["RssAnon"] - before["RssAnon"], 1),
        "file_added_mib": round(after["RssFile"] - before["RssFile"], 1),
        "rss_before_mib": round(before["VmRSS"], 1),
        "peak_reset": reset,
        "imported_by_steps": imported,
        "python_peak_mib": python_mib,
        "live_tensor_peak_mib": tensors_mib,
    }


def _fresh_process(spec: dict[str, Any], pythonpath: str | None) -> dict[str, Any]:
    """``measure_scenario(spec)`` in a fresh interpreter with the malloc settings (and
    ``pythonpath`` first on the path when given)."""
    env = {**os.environ, **MALLOC_ENV}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"memory process {spec} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def checkout_of(headkit_dir: str) -> dict[str, str]:
    """The folder a headkit was imported from and its checkout's commit."""
    run = {"capture_output": True, "text": True}
    commit = subprocess.run(["git", "-C", headkit_dir, "log", "-1", "--format=%h %s"], **run)
    dirty = subprocess.run(
        ["git", "-C", headkit_dir, "status", "--porcelain", "--untracked-files=no", "headkit"],
        **run,
    )
    changes = " (+changes)" if dirty.stdout.strip() else ""
    return {"path": headkit_dir, "commit": commit.stdout.strip()[:72] + changes}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_measure_args(ap)  # --steps: train steps measured (20; quick 3); no warm-up here
    ap.add_argument("--arch", default=None, help="gpt2,llama (quick: gpt2)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="bare,token,sequence")
    ap.add_argument("--repeats", type=int, default=None, help="fresh processes each (5)")
    ap.add_argument("--compare", default=None, help="another checkout's folder (PYTHONPATH)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / f"{NAME}.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Measure every scenario; return (and write to --out) the result with its figures."""
    args = parse_args(argv)
    if args.child:
        out = measure_scenario(json.loads(args.child))
        print(json.dumps(out))
        return out
    st = settings_of(args)
    sizes = QUICK_SIZES if st.quick else SIZES
    args.arch = args.arch or ("gpt2" if st.quick else ",".join(ARCHS))
    archs, kinds = args.arch.split(","), args.kinds.split(",")
    repeats = args.repeats or (1 if st.quick else 5)
    sides: dict[str, str | None] = {"headkit": None}
    if args.compare:
        sides["compare"] = str(Path(args.compare).resolve())
    runs: dict[tuple[str, str, str], list[dict]] = {}
    for _ in range(repeats):  # alternated: every scenario and side once per round
        for arch in archs:
            for kind in kinds:
                for side, path in sides.items():
                    if kind == "bare" and side != "headkit":
                        continue  # no headkit in it: one floor for both sides
                    spec = {"arch": arch, "kind": kind, "sizes": sizes, "steps": st.steps}
                    spec["threads"] = st.threads
                    in_process = st.quick and path is None  # another headkit: its own process
                    got = measure_scenario(spec) if in_process else _fresh_process(spec, path)
                    runs.setdefault((side, arch, kind), []).append(got)
                    print(
                        f"{side:8s} {arch:6s} {kind:9s} +{got['increment_mib']:.1f} MiB "
                        f"(first step +{got['first_step_mib']:.1f})",
                        flush=True,
                    )
    result = _result(args, st, sizes, sides, runs, repeats)
    write_result(result, args.out)
    return result


def _result(args, st, sizes, sides, runs, repeats) -> dict:
    def med(side: str, arch: str, kind: str, key: str = "increment_mib") -> float | None:
        vals = [r[key] for r in runs.get((side, arch, kind), []) if r[key] is not None]
        return statistics.median(vals) if vals else None

    details = {}
    for (side, arch, kind), rs in runs.items():
        inc = [r["increment_mib"] for r in rs]
        details[f"{side}/{arch}/{kind}"] = {
            "increment_mib": {"median": med(side, arch, kind), "min": min(inc), "max": max(inc)},
            **{
                f"{key}_median": med(side, arch, kind, key)
                for key in ("first_step_mib", "anon_added_mib", "file_added_mib")
            },
            "python_peak_mib_median": med(side, arch, kind, "python_peak_mib"),
            "live_tensor_peak_mib_median": med(side, arch, kind, "live_tensor_peak_mib"),
            "imported_by_steps": sorted({m for r in rs for m in r["imported_by_steps"]}),
            "runs": rs,
        }
    figures = []
    n = st.steps
    measures = (
        ("increment_mib", f"peak RSS above the built model, {n} steps", FLOOR_GOAL, None),
        ("live_tensor_peak_mib", "peak of live tensors in a step", TENSOR_GOAL, COMPARE_GOAL),
    )
    for arch in args.arch.split(","):
        for kind in args.kinds.split(","):
            for key, what, floor_goal, compare_goal in measures:
                now, floor = med("headkit", arch, kind, key), med("headkit", arch, "bare", key)
                old = med("compare", arch, kind, key)
                if now is None:
                    continue
                figures.append(figure(f"{arch} {kind}: {what}", now, "MiB"))
                if old is not None:
                    figures.append(figure(f"{arch} {kind} (compared headkit): {what}", old, "MiB"))
                if kind == "bare":
                    continue
                if floor:
                    figures.append(
                        figure(
                            f"{arch} {kind} ÷ bare model + nn.Linear: {what}",
                            now / floor,
                            "ratio",
                            floor_goal,
                        )
                    )
                if old:
                    figures.append(
                        figure(
                            f"{arch} {kind}, this headkit ÷ the compared one: {what}",
                            now / old,
                            "ratio",
                            compare_goal,
                        )
                    )
    settings = {
        **st.as_dict(),
        "sizes": sizes,
        "archs": args.arch,
        "kinds": args.kinds,
        "train_steps": st.steps,
        "repeats": repeats,
        "fresh_processes": not st.quick,
        "malloc_env_in_processes": MALLOC_ENV,
        "headkit": {
            side: checkout_of(path)
            for (side, _, _), rs in runs.items()
            for path in {r["headkit"] for r in rs if r["headkit"]}
        },
    }
    return bench_result(NAME, figures, settings, details, threads=st.threads)


if __name__ == "__main__":
    ensure_bench_env()
    main()
