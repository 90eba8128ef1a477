"""What does generating with a value head cost? ``HeadedModel.generate`` vs the backbone's own.

Both generate greedily from the same left-padded batch of 8 prompts, 64 new tokens each (no eos,
so every call makes all 64), in one process, measured by the suite's harness (``_harness``:
warm-up, calls alternated A B, B A, ..., medians, rerun when other processes loaded the
machine):
  backbone  LlamaForCausalLM.generate                                     (reference)
  headkit   HeadedModel.generate with the frozen lm_head (it shares the tied embeddings) and one
            value head (one Linear) on the last layer, whose output comes back for every
            generated token, with the log-probability of every token
The model: a tiny random Llama decoder built from a config (12 layers, hidden 256, vocabulary
32000, tied embeddings), 2 threads. The figure is tokens/s of headkit ÷ tokens/s of the
backbone, the ratio of the medians (goal >= 0.95); the median of the per-call-pair ratios is
in the details, with whether both generated the same tokens.

Run (writes benchmarks/results/generation.json; ``--quick``: tiny sizes, a smoke test):
  HF_HUB_OFFLINE=1 python benchmarks/bench_generation.py
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from _harness import Goal, add_measure_args, ensure_bench_env, settings_of
from _report import bench_result, figure, publish
from transformers import LlamaConfig, LlamaForCausalLM

from headkit import HeadConfig, HeadedModel

HERE = Path(__file__).resolve().parent
NAME = "generation"
GOAL = Goal(">=", 0.95)


@dataclass(frozen=True)
class Shape:
    layers: int = 12
    hidden: int = 256
    vocab: int = 32000
    batch: int = 8
    new: int = 64
    prompt: int = 32


QUICK = Shape(layers=2, hidden=64, vocab=1000, batch=2, new=4, prompt=8)


def build(s: Shape) -> tuple[LlamaForCausalLM, HeadedModel, dict[str, torch.Tensor]]:
    """The backbone, a HeadedModel on it, and a left-padded batch (prompt lengths from
    ``s.prompt`` down to about a third of it)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=s.layers,
        hidden_size=s.hidden,
        intermediate_size=4 * s.hidden,
        num_attention_heads=max(1, s.hidden // 64),
        num_key_value_heads=max(1, s.hidden // 64),
        vocab_size=s.vocab,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=None,  # no row stops early: every call generates s.new tokens
        pad_token_id=0,
    )
    hf = LlamaForCausalLM(cfg).eval()
    heads = [
        HeadConfig("lm_head", is_causal_lm=True, trainable=False),
        HeadConfig("value", num_outputs=1, is_regression=True, loss_fct="mse"),
    ]
    headed = HeadedModel(hf, heads).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, s.vocab, (s.batch, s.prompt), generator=g)
    lengths = torch.linspace(s.prompt, max(1, s.prompt // 3), s.batch).long()
    mask = (torch.arange(s.prompt)[None, :] >= s.prompt - lengths[:, None]).long()
    return hf, headed, {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def main(argv: list[str] | None = None) -> dict:
    """Measure; return (and write to --out) the result with its figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_measure_args(ap)
    ap.add_argument("--out", type=Path, default=HERE / "results" / f"{NAME}.json")
    args = ap.parse_args(argv)
    st = settings_of(args)
    shape = QUICK if st.quick else Shape()
    torch.set_num_threads(st.threads)
    hf, headed, batch = build(shape)
    settings = {"max_new_tokens": shape.new, "do_sample": False}
    with torch.inference_mode():
        check = headed.generate(**batch, **settings)
        same = torch.equal(check.sequences, hf.generate(**batch, **settings))
    if check.head_outputs["value"].shape != (shape.batch, shape.new, 1):
        raise RuntimeError(f"value head outputs of shape {check.head_outputs['value'].shape}")

    def inference(fn):
        def run():
            with torch.inference_mode():
                return fn()

        return run

    t = st.measure(
        {
            "backbone": inference(lambda: hf.generate(**batch, **settings)),
            "headkit": inference(lambda: headed.generate(**batch, **settings)),
        }
    )
    tokens = shape.batch * shape.new
    pairs = [b / h for b, h in zip(t.samples["backbone"], t.samples["headkit"])]
    figures = [
        figure(
            "tokens/s, HeadedModel.generate (lm_head + value head) ÷ the backbone's generate",
            t.ratio("backbone", "headkit"),  # (tokens / headkit_s) / (tokens / backbone_s)
            "ratio",
            GOAL,
        ),
        figure("tokens/s, HeadedModel.generate", tokens / t.median["headkit"], "tokens/s"),
        figure("tokens/s, the backbone's generate", tokens / t.median["backbone"], "tokens/s"),
    ]
    details = {
        **t.summary(tokens),
        "median_of_pair_ratios": round(statistics.median(pairs), 4),
        "same_tokens": same,
        "loads": t.loads,
    }
    setting = {
        **st.as_dict(),
        "model": {**asdict(shape), "arch": "random LlamaForCausalLM, tied embeddings"},
        "generate": {**settings, "prompts": "left-padded"},
    }
    result = bench_result(NAME, figures, setting, details, threads=st.threads)
    return publish(result, args.out)


if __name__ == "__main__":
    ensure_bench_env()
    main()
