"""What does a probe on layer k cost? headkit's early exit vs a full forward pass.

Ratios are measured inside one process with the scenarios alternated step by step (A B C ...),
median of each (see shared BENCHMARKING.md). Peak memory: one fresh process per scenario.

Scenarios, on tiny randomly initialised 12-layer GPT-2 and Llama models (hidden 256,
batch 8 x 128 tokens, 2 threads, inference):
  full        the bare backbone, every block                           (reference)
  floor_k     the same backbone truncated to k blocks                  (physical floor)
  headkit_k   HeadedModel with one linear probe on layer k             (early exit)
  headkit_L   HeadedModel with one linear probe on the last layer
  allstates_k predecessor design: every block, output_hidden_states=True, probe on [k]

Run: make bench   (or: python benchmarks/bench_early_exit.py --out benchmarks/results/early_exit.md)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2Model, LlamaConfig, LlamaModel

from headkit import HeadConfig, HeadedModel

LAYERS, HIDDEN, BATCH, SEQ = 12, 256, 8, 128
MEM_BATCH, MEM_SEQ = 32, 256  # memory: a batch where activations dominate allocator noise


def build(arch: str, n_layers: int = LAYERS):
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = GPT2Config(
            n_layer=n_layers, n_embd=HIDDEN, n_head=4, vocab_size=1000, n_positions=256
        )
        return GPT2Model(cfg).eval()
    cfg = LlamaConfig(
        num_hidden_layers=n_layers,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=1000,
    )
    return LlamaModel(cfg).eval()


def truncated(model, k: int):
    """A copy of ``model`` holding only its first k blocks (the cost floor of a layer-k probe)."""
    m = copy.deepcopy(model)
    info = HeadedModel(m, [HeadConfig("x")]).info
    parent = m.get_submodule(info.layers_path.rsplit(".", 1)[0]) if "." in info.layers_path else m
    name = info.layers_path.rsplit(".", 1)[-1]
    setattr(parent, name, torch.nn.ModuleList(list(info.layers)[:k]))
    m.config.num_hidden_layers = k
    if hasattr(m.config, "n_layer"):
        m.config.n_layer = k
    return m


def scenarios(arch: str, k: int, batch: int = BATCH, seq: int = SEQ):
    model = build(arch)
    ids = torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(1))
    probe_k = HeadedModel(model, [HeadConfig("probe", layer_hook=k, num_outputs=2)]).eval()
    probe_last = HeadedModel(model, [HeadConfig("probe", layer_hook=-1, num_outputs=2)]).eval()
    floor = truncated(model, k)
    lin = torch.nn.Linear(HIDDEN, 2)
    return {
        "full": lambda: model(ids, use_cache=False),
        f"floor_{k}": lambda: floor(ids, use_cache=False),
        f"headkit_{k}": lambda: probe_k(ids),
        f"headkit_{LAYERS}": lambda: probe_last(ids),
        f"allstates_{k}": lambda: lin(
            model(ids, use_cache=False, output_hidden_states=True).hidden_states[k]
        ),
    }


def cpu_busy_seconds() -> float:
    """CPU seconds all processes spent busy so far (from /proc/stat, USER_HZ = 100)."""
    with open("/proc/stat") as f:
        vals = [float(x) for x in f.readline().split()[1:]]
    return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


def time_all(arch: str, k: int, warmup: int, steps: int) -> dict[str, float]:
    runs = scenarios(arch, k)
    times: dict[str, list[float]] = {n: [] for n in runs}
    with torch.inference_mode():
        for _ in range(warmup):
            for fn in runs.values():
                fn()
        for _ in range(steps):
            for name, fn in runs.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    return {n: statistics.median(v) for n, v in times.items()}


def peak_memory(arch: str, k: int, name: str) -> float:
    """Peak RSS (MiB) reached while running one scenario, above the RSS before it.

    A fresh process builds the models, resets the kernel's peak-RSS counter
    (``/proc/self/clear_refs``), runs the scenario twice and reads ``VmHWM``.
    """
    code = (
        "import sys, torch; sys.path.insert(0, %r); import bench_early_exit as b;"
        "torch.set_num_threads(2); fn = b.scenarios(%r, %d, b.MEM_BATCH, b.MEM_SEQ)[%r];"
        "kb = lambda key: int([l for l in open('/proc/self/status') if l.startswith(key)][0]"
        ".split()[1]);"
        "open('/proc/self/clear_refs', 'w').write('5'); base = kb('VmRSS')\n"
        "with torch.inference_mode():\n    fn(); fn()\n"
        "print((kb('VmHWM') - base) / 1024)"
    ) % (str(Path(__file__).parent), arch, k, name)
    # plain glibc settings here: the benchmark's malloc padding would hide the peak
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    return float(out.stdout.strip().splitlines()[-1])


def median_peak_memory(arch: str, k: int, name: str, repeats: int = 3) -> float:
    return statistics.median(peak_memory(arch, k, name) for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--archs", default="gpt2,llama")
    ap.add_argument("--out", default="benchmarks/results/early_exit.md")
    ap.add_argument("--no-memory", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    k = args.k
    lines = [
        "# Early exit: cost of a probe on layer %d of %d" % (k, LAYERS),
        "",
        f"Tiny random models, hidden {HIDDEN}, batch {BATCH} x {SEQ} tokens, 2 threads, "
        f"inference; median of {args.steps} alternated steps after {args.warmup} warm-up.",
        f"Command: `{' '.join(['python'] + sys.argv)}` (with the malloc settings of `make bench`).",
        "",
        "| model | headkit layer-%d / full | headkit layer-%d / %d-block floor | "
        "headkit last layer / full | predecessor design (all states) layer-%d / %d-block floor "
        "| other processes' CPU load |" % (k, k, k, k, k),
        "|---|---|---|---|---|---|",
    ]
    results = {}
    for arch in args.archs.split(","):
        busy0, own0, t0 = cpu_busy_seconds(), time.process_time(), time.perf_counter()
        med = time_all(arch, k, args.warmup, args.steps)
        wall = time.perf_counter() - t0
        # cores used by other processes meanwhile (> ~0.2: treat the numbers as noisy)
        load = (cpu_busy_seconds() - busy0 - (time.process_time() - own0)) / wall
        r = {
            "full_ms": med["full"] * 1e3,
            "k_over_full": med[f"headkit_{k}"] / med["full"],
            "k_over_floor": med[f"headkit_{k}"] / med[f"floor_{k}"],
            "last_over_full": med[f"headkit_{LAYERS}"] / med["full"],
            "allstates_over_floor": med[f"allstates_{k}"] / med[f"floor_{k}"],
            "wall_s": wall,
        }
        if not args.no_memory:
            for name in ("full", f"headkit_{k}", f"allstates_{k}"):
                r[f"peak_mib_{name}"] = median_peak_memory(arch, k, name)
        results[arch] = r
        print(arch, json.dumps(r, indent=1), flush=True)
        lines.append(
            f"| {arch} | {r['k_over_full']:.3f} | {r['k_over_floor']:.2f} | "
            f"{r['last_over_full']:.2f} | {r['allstates_over_floor']:.2f} | "
            f"{load:.2f} cores |"
        )
    if not args.no_memory:
        lines += [
            "",
            f"Peak RSS while running, above the RSS before (MiB; batch {MEM_BATCH} x {MEM_SEQ}, "
            "median of 3 fresh processes per scenario):",
            "",
            "| model | full | headkit layer-%d | predecessor design layer-%d |" % (k, k),
            "|---|---|---|---|",
        ]
        for arch, r in results.items():
            lines.append(
                f"| {arch} | {r['peak_mib_full']:.0f} | {r[f'peak_mib_headkit_{k}']:.0f} "
                f"| {r[f'peak_mib_allstates_{k}']:.0f} |"
            )
    lines += [
        "",
        "Full forward, median: "
        + ", ".join(f"{a} {r['full_ms']:.1f} ms" for a, r in results.items()),
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
