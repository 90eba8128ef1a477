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
backbone, the ratio of the medians (goal >= 0.97); the median of the per-call-pair ratios is
in the details, with whether both generated the same tokens.

Run (writes benchmarks/results/generation.json; ``--quick``: tiny sizes, a smoke test):
  HF_HUB_OFFLINE=1 python benchmarks/bench_generation.py

On a GPU (``--device cuda``; each call timed between ``torch.cuda.synchronize()``), e.g. a
1.1B Llama shape in bfloat16, as ``benchmarks/gpu_check.py`` runs it:
  python benchmarks/bench_generation.py --device cuda --dtype bfloat16 --layers 22 \
      --hidden 2048 --heads 32 --kv-heads 4 --intermediate 5632 --batch 8 --new 128
The backbone is cast to ``--dtype``; the heads are left as headkit makes them. The size
options override the default (or ``--quick``) shape one by one. Whether headkit's greedy
tokens equal the backbone's in that dtype is in the details (``same_tokens``; off the CPU
float32 default also ``first_different_token``, the first new token where they part).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from _harness import Goal, add_measure_args, ensure_bench_env, settings_of
from _report import bench_result, figure, publish
from transformers import LlamaConfig, LlamaForCausalLM

from headkit import HeadConfig, HeadedModel

HERE = Path(__file__).resolve().parent
NAME = "generation"
GOAL = Goal(">=", 0.97)  # issue 30: tokens/s within 3 % of the backbone's generate


@dataclass(frozen=True)
class Shape:
    layers: int = 12
    hidden: int = 256
    vocab: int = 32000
    batch: int = 8
    new: int = 64
    prompt: int = 32
    heads: int | None = None  # attention heads; None: hidden // 64
    kv_heads: int | None = None  # key-value heads; None: as many as the attention heads
    intermediate: int | None = None  # MLP width; None: 4 x hidden


QUICK = Shape(layers=2, hidden=64, vocab=1000, batch=2, new=4, prompt=8)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Shape fields settable from the command line (``--kv-heads`` sets ``kv_heads``).
SIZE_FIELDS = ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab")
SIZE_FIELDS += ("batch", "new", "prompt")


def resolved(s: Shape) -> Shape:
    """``s`` with the derived sizes (heads, kv_heads, intermediate) filled in."""
    heads = s.heads or max(1, s.hidden // 64)
    return replace(
        s, heads=heads, kv_heads=s.kv_heads or heads, intermediate=s.intermediate or 4 * s.hidden
    )


def build(
    s: Shape, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[LlamaForCausalLM, HeadedModel, dict[str, torch.Tensor]]:
    """The backbone (in ``dtype``), a HeadedModel on it, and a left-padded batch (prompt
    lengths from ``s.prompt`` down to about a third of it), all on ``device``."""
    torch.manual_seed(0)
    s = resolved(s)
    cfg = LlamaConfig(
        num_hidden_layers=s.layers,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        vocab_size=s.vocab,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=None,  # no row stops early: every call generates s.new tokens
        pad_token_id=0,
    )
    with torch.device(device):  # a large model is initialised where it runs
        hf = LlamaForCausalLM(cfg).eval()
    if dtype != torch.float32:
        hf = hf.to(dtype)
    heads = [
        HeadConfig("lm_head", is_causal_lm=True, trainable=False),
        HeadConfig("value", num_outputs=1, is_regression=True, loss_fct="mse"),
    ]
    headed = HeadedModel(hf, heads).to(device).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, s.vocab, (s.batch, s.prompt), generator=g)
    lengths = torch.linspace(s.prompt, max(1, s.prompt // 3), s.batch).long()
    mask = (torch.arange(s.prompt)[None, :] >= s.prompt - lengths[:, None]).long()
    batch = {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}
    return hf, headed, {k: v.to(device) for k, v in batch.items()}


def first_difference(a: torch.Tensor, b: torch.Tensor, prompt: int) -> int | None:
    """The first new-token position (0-based) where two generated batches differ, or None."""
    if a.shape != b.shape:
        return 0
    differs = (a[:, prompt:] != b[:, prompt:]).any(dim=0).nonzero()
    return int(differs[0]) if len(differs) else None


def main(argv: list[str] | None = None) -> dict:
    """Measure; return (and write to --out) the result with its figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_measure_args(ap)
    ap.add_argument("--out", type=Path, default=HERE / "results" / f"{NAME}.json")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    for name in SIZE_FIELDS:
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, dest=name)
    args = ap.parse_args(argv)
    sizes = {n: getattr(args, n) for n in SIZE_FIELDS if getattr(args, n) is not None}
    for name, value in sizes.items():
        if value < 1:
            ap.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no CUDA device")
    st = settings_of(args)
    shape = resolved(replace(QUICK if st.quick else Shape(), **sizes))
    torch.set_num_threads(st.threads)
    cuda = args.device == "cuda"
    hf, headed, batch = build(shape, args.device, DTYPES[args.dtype])
    settings = {"max_new_tokens": shape.new, "do_sample": False}
    with torch.inference_mode():
        check = headed.generate(**batch, **settings)
        reference = hf.generate(**batch, **settings)
        same = torch.equal(check.sequences, reference)
        first = first_difference(check.sequences, reference, batch["input_ids"].shape[1])
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
        },
        sync=torch.cuda.synchronize if cuda else lambda: None,
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
    if cuda or args.dtype != "float32":
        details["first_different_token"] = first
    setting = {
        **st.as_dict(),
        "model": {**asdict(shape), "arch": "random LlamaForCausalLM, tied embeddings"},
        "generate": {**settings, "prompts": "left-padded"},
    }
    if cuda or args.dtype != "float32":
        setting["device"], setting["dtype"] = args.device, args.dtype
        if cuda:
            setting["gpu"] = torch.cuda.get_device_name(0)
    result = bench_result(NAME, figures, setting, details, threads=st.threads)
    return publish(result, args.out)


if __name__ == "__main__":
    ensure_bench_env()
    main()
