"""What does a LoRA train step with a head cost? ``create_headed_qlora`` vs peft's own recipe.

One process, the suite's harness (``_harness``: warm-up, the scenarios alternated step by step
A B C, C B A, ..., medians, rerun when other processes loaded the machine), per shared
BENCHMARKING.md. A tiny randomly initialised 12-layer Llama (hidden 256, batch 8 x 128
tokens, 2 threads), LoRA r=8 alpha=16 on the same targets, AdamW, a full train step
(forward, backward, optimizer step):

  peft     peft's recipe: LlamaForSequenceClassification + LoraConfig(task_type="SEQ_CLS")
           (targets: every linear layer of every block; the ``score`` layer trained fully)
  last     create_headed_qlora, one sequence head (last-token pooling) on the last layer:
           headkit's default targets, which are the same every-linear-of-every-block set
  layer2   create_headed_qlora, the head on layer 2 of 12: early exit, LoRA in blocks 0-1

Goals (ratios of the medians): last / peft <= 1.05; layer2 / peft (the full step) <= 0.3.
Cross-check: the same steps on one thread, this process's CPU seconds per step, which other
processes' load hardly moves (on two threads, waiting threads may spin).

Run (writes benchmarks/results/lora.json; ``--quick``: tiny sizes, a smoke test):
  HF_HUB_OFFLINE=1 python benchmarks/bench_lora.py
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from _harness import Goal, add_measure_args, ensure_bench_env, settings_of
from _report import bench_result, figure, publish
from peft import LoraConfig, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from headkit import HeadConfig, create_headed_qlora

HERE = Path(__file__).resolve().parent
NAME = "lora"
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0}
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GOALS = {"last": Goal("<=", 1.05), "layer2": Goal("<=", 0.3)}


@dataclass(frozen=True)
class Shape:
    layers: int = 12
    hidden: int = 256
    batch: int = 8
    seq: int = 128
    vocab: int = 1000


QUICK = Shape(layers=4, hidden=64, batch=2, seq=16)


def save_base(folder: Path, s: Shape) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=s.layers,
        hidden_size=s.hidden,
        intermediate_size=4 * s.hidden,
        num_attention_heads=max(1, s.hidden // 64),
        num_key_value_heads=max(1, s.hidden // 64),
        vocab_size=s.vocab,
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


def scenarios(base: Path, s: Shape) -> tuple[dict[str, Callable[[], float]], dict[str, int]]:
    """One train step per scenario (each with its own model and AdamW)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, s.vocab, (s.batch, s.seq), generator=g)
    mask = torch.ones_like(ids)
    labels = torch.randint(0, 2, (s.batch,), generator=g)

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


def main(argv: list[str] | None = None) -> dict:
    """Measure; return (and write to --out) the result with its figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_measure_args(ap)
    ap.add_argument("--cpu-steps", type=int, default=None, help="1-thread CPU-time steps (6)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / f"{NAME}.json")
    args = ap.parse_args(argv)
    st = settings_of(args)
    shape = QUICK if st.quick else Shape()
    cpu_steps = args.cpu_steps or (2 if st.quick else 6)
    torch.set_num_threads(st.threads)
    with tempfile.TemporaryDirectory() as tmp:
        runs, trainable = scenarios(save_base(Path(tmp) / "llama", shape), shape)
        t = st.measure(runs)
        torch.set_num_threads(1)  # the cross-check: CPU seconds per step on one thread
        one = st.measure(runs, warmup=2, steps=cpu_steps)
        torch.set_num_threads(st.threads)
    figures = [
        figure(
            "train step, headed LoRA, head on the last layer ÷ peft's recipe",
            t.ratio("last", "peft"),
            "ratio",
            GOALS["last"],
        ),
        figure(
            "train step, headed LoRA, head on layer 2 ÷ peft's recipe",
            t.ratio("layer2", "peft"),
            "ratio",
            GOALS["layer2"],
        ),
        figure(
            "one thread, CPU time: head on the last layer ÷ peft's recipe",
            one.cpu_ratio("last", "peft"),
            "ratio",
        ),
        figure(
            "one thread, CPU time: head on layer 2 ÷ peft's recipe",
            one.cpu_ratio("layer2", "peft"),
            "ratio",
        ),
    ]
    details = {
        **t.summary(shape.batch * shape.seq),
        "loads": t.loads,
        "layer2_over_last": round(t.ratio("layer2", "last"), 4),
        "trainable_params": trainable,
        "one_thread": one.summary(),
    }
    setting = {
        **st.as_dict(),
        "model": {**asdict(shape), "arch": "random Llama"},
        "lora": {**LORA, "targets": "every linear layer of the blocks that run"},
        "step": "forward + backward + AdamW step",
        "cpu_steps": cpu_steps,
    }
    result = bench_result(NAME, figures, setting, details, threads=st.threads)
    return publish(result, args.out)


if __name__ == "__main__":
    ensure_bench_env()
    main()
