"""What does a LoRA train step with a head cost? ``create_headed_qlora`` vs peft's own recipe.

One process, the scenarios alternated step by step (A B C A B C ...), median of each, per
shared BENCHMARKING.md. A tiny randomly initialised 12-layer Llama (hidden 256, batch
8 x 128 tokens, 2 threads), LoRA r=8 alpha=16 on the same targets, AdamW, a full train step
(forward, backward, optimizer step):

  peft     peft's recipe: LlamaForSequenceClassification + LoraConfig(task_type="SEQ_CLS")
           (targets: every linear layer of every block; the ``score`` layer trained fully)
  last     create_headed_qlora, one sequence head (last-token pooling) on the last layer:
           headkit's default targets, which are the same every-linear-of-every-block set
  layer2   create_headed_qlora, the head on layer 2 of 12: early exit, LoRA in blocks 0-1

Goals: last / peft <= 1.05; layer2 / peft (the full step) <= 0.3. Each round (one step of
each scenario) is checked for other processes' CPU load (/proc/stat); rounds over 0.2 cores
are left out of the medians when enough clean rounds remain; ``paired_*`` are the medians of
the per-round ratios. Cross-check: the same steps on one thread, CPU seconds per step, which
other processes' load hardly moves (on two threads, waiting threads spin and it would).

Run: make bench, or
  MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 \\
  MALLOC_TOP_PAD_=536870912 HF_HUB_OFFLINE=1 python benchmarks/bench_lora.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _harness import MALLOC_ENV, busy_seconds  # noqa: E402
from peft import LoraConfig, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from headkit import HeadConfig, create_headed_qlora

LAYERS, HIDDEN, BATCH, SEQ, VOCAB = 12, 256, 8, 128, 1000
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0}
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_LOAD = 0.2  # cores used by other processes during a round before it is left out
RESULTS = Path(__file__).parent / "results" / "lora.json"


def save_base(folder: Path) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=LAYERS,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        pad_token_id=0,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def adapted(module: torch.nn.Module) -> set[str]:
    """Adapted layers as (block index, linear name), whatever the module path."""
    out = set()
    for name, m in module.named_modules():
        if isinstance(m, BaseTunerLayer):
            parts = name.split(".")
            i = parts.index("layers")
            out.add(f"{parts[i + 1]}.{parts[-1]}")
    return out


def scenarios(base: Path) -> tuple[dict[str, Callable[[], float]], dict[str, int]]:
    """One train step per scenario (each with its own model and AdamW)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    labels = torch.randint(0, 2, (BATCH,), generator=g)

    torch.manual_seed(0)
    seq_cls = LlamaForSequenceClassification.from_pretrained(base, num_labels=2)
    peft_model = get_peft_model(
        seq_cls, LoraConfig(task_type="SEQ_CLS", target_modules=LINEARS, **LORA)
    )
    head = HeadConfig("cls", num_outputs=2, pred_for_sequence=True, pooling="last")
    last = create_headed_qlora(base, lora_config=LoraConfig(**LORA), head_configs=[head])
    layer2 = create_headed_qlora(
        base, lora_config=LoraConfig(**LORA), head_configs=[head.replace(layer_hook=2)]
    )
    if adapted(last.backbone) != adapted(peft_model):
        raise RuntimeError("headkit's default LoRA targets differ from peft's recipe's")

    def step(model: torch.nn.Module, run: Callable[[], torch.Tensor]) -> Callable[[], float]:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        model.train()

        def one() -> float:
            loss = run()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        return one

    runs = {
        "peft": step(peft_model, lambda: peft_model(ids, attention_mask=mask, labels=labels).loss),
        "last": step(last, lambda: last(ids, attention_mask=mask, cls=labels).loss),
        "layer2": step(layer2, lambda: layer2(ids, attention_mask=mask, cls=labels).loss),
    }
    trainable = {
        "peft": sum(p.numel() for p in peft_model.parameters() if p.requires_grad),
        "last": sum(p.numel() for p in last.parameters() if p.requires_grad),
        "layer2": sum(p.numel() for p in layer2.parameters() if p.requires_grad),
    }
    return runs, trainable


def time_rounds(runs: dict[str, Callable[[], float]], warmup: int, rounds: int) -> list[dict]:
    for _ in range(warmup):
        for fn in runs.values():
            fn()
    out = []
    for _ in range(rounds):
        busy0, own0, t0 = busy_seconds(), time.process_time(), time.perf_counter()
        times = {}
        for name, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[name] = time.perf_counter() - t
        wall = time.perf_counter() - t0
        times["other_cores"] = (busy_seconds() - busy0 - (time.process_time() - own0)) / wall
        out.append(times)
    return out


def cpu_one_thread(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Median CPU seconds per step on one thread, the scenarios alternated."""
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {n: [] for n in runs}
    for i in range(rounds + 2):  # two warm-up rounds at the new thread count
        for name, fn in runs.items():
            c = time.process_time()
            fn()
            if i >= 2:
                times[name].append(time.process_time() - c)
    return {n: statistics.median(v) for n, v in times.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument(
        "--min-clean", type=int, default=10, help="clean rounds needed to drop loaded ones"
    )
    ap.add_argument("--cpu-rounds", type=int, default=6, help="1-thread CPU-time rounds")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        runs, trainable = scenarios(save_base(Path(tmp) / "llama"))
        rounds = time_rounds(runs, args.warmup, args.rounds)
        cpu = cpu_one_thread(runs, args.cpu_rounds)
        torch.set_num_threads(2)
    clean = [r for r in rounds if r["other_cores"] <= MAX_LOAD]
    used = clean if len(clean) >= args.min_clean else rounds
    med = {n: statistics.median(r[n] for r in used) for n in runs}
    result = {
        "setting": {
            "model": f"random Llama, {LAYERS} layers, hidden {HIDDEN}, vocab {VOCAB}",
            "batch": f"{BATCH} x {SEQ} tokens",
            "lora": {**LORA, "targets": "every linear layer of the blocks that run"},
            "step": "forward + backward + AdamW step",
            "threads": 2,
            "torch": torch.__version__,
            "malloc_env": all(k in os.environ for k in MALLOC_ENV),
            "warmup": args.warmup,
            "rounds": args.rounds,
            "argv": list(argv) if argv is not None else None,
        },
        "median_ms": {n: v * 1e3 for n, v in med.items()},
        "trainable_params": trainable,
        "last_over_peft": med["last"] / med["peft"],
        "layer2_over_peft": med["layer2"] / med["peft"],
        "layer2_over_last": med["layer2"] / med["last"],
        # the same ratios taken within each round (paired: robust to load drifting across rounds)
        "paired_last_over_peft": statistics.median(r["last"] / r["peft"] for r in used),
        "paired_layer2_over_peft": statistics.median(r["layer2"] / r["peft"] for r in used),
        # one thread, CPU seconds per step: no thread waits on another, so other processes
        # taking the cores hardly change it (the cross-check when the machine was loaded)
        "cpu_1thread_ms": {n: v * 1e3 for n, v in cpu.items()},
        "cpu_1thread_last_over_peft": cpu["last"] / cpu["peft"],
        "cpu_1thread_layer2_over_peft": cpu["layer2"] / cpu["peft"],
        "goals": {"last_over_peft": 1.05, "layer2_over_peft": 0.3},
        "rounds_used": len(used),
        "rounds_clean": len(clean),
        "other_cores_median": statistics.median(r["other_cores"] for r in rounds),
    }
    result["goals_met"] = {k: result[k] <= v for k, v in result["goals"].items()}
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
