"""Counting the aten operations a step dispatches: what a head costs, independent of the clock.

On a GPU every dispatched operation is (at least) one kernel launch, so for small batches the
number of operations, not their arithmetic, sets the time. Counts are deterministic, so they
are both a benchmark figure (``bench_op_counts.py``) and a test that fails on a regression
(``tests/model/test_op_counts.py``).

- ``OpCounter``: a ``TorchDispatchMode`` counting every aten operation but view-like ones
  (``view``, ``t``, ``expand``, ``detach``, ``alias``, slicing, ...: an operation whose schema
  returns an alias of its input, plus ``_unsafe_view`` and ``lift_fresh``), which launch no
  kernel. Host reads (``_local_scalar_dense``) are counted, and reported apart too.
- ``train_step_ops``: one frozen train step (forward with labels, backward) of a HeadedModel
  with ``n`` same-kind heads on the last layer of a tiny GPT-2, Llama or BERT; ``per_extra_head``
  is the difference between 1 and ``n`` heads divided by ``n - 1``. Each head runs alone, as
  on a GPU: on the CPU same-shape heads may run as one matmul (``heads/stacked.py``), which
  only lowers the count, so a no-op forward hook on each head's Linear keeps it out.
- ``decode_step_ops``: one greedy decode step of ``generate``, the backbone's own
  (``*ForCausalLM.generate``) or HeadedModel's with its frozen ``lm_head`` and a value head:
  the operations of generating ``k + m`` tokens minus those of ``k``, divided by ``m``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

from headkit import HeadConfig, HeadedModel

ARCHS = ("gpt2", "llama", "bert")
DECODERS = ("gpt2", "llama")
#: The heads measured per extra head: a sequence head (mean pooling, CE), a token head (CE) and
#: a sequence regression head (mean pooling, MSE).
KINDS = ("sequence_ce", "token_ce", "regression_mse")
#: Goals: each extra head at most this many operations (fwd + bwd of a frozen train step) ...
MAX_OPS_PER_EXTRA_HEAD = 12
#: ... and once heads share one loss call (``losses.shared``), each further head at most this
#: many: its matmul, its weight gradient's, the sum of its losses' row and the total's add.
MAX_OPS_PER_STACKED_HEAD = 4
#: ... and a decode step with heads at most this factor of the backbone's own step, plus the
#: heads' own matmuls.
MAX_DECODE_STEP_FACTOR = 1.02
#: Operations that return a view or alias but do not say so in their schema.
_VIEW_LIKE = frozenset({"_unsafe_view", "lift_fresh"})
HOST_READ = "_local_scalar_dense"
MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"})

VOCAB, HIDDEN, LAYERS = 100, 32, 2
BATCH, SEQ = 2, 8


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as c: ...`` → ``c.counts``: compute operations by name (views left
    out, see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in _VIEW_LIKE:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def count_ops(fn: Callable[[], Any]) -> collections.Counter[str]:
    """The compute operations ``fn()`` dispatches, by name."""
    with OpCounter() as counter:
        fn()
    return counter.counts


# ---------------------------------------------------------------------- models
def build_model(arch: str, seed: int = 0) -> PreTrainedModel:
    """A tiny random model (2 layers, hidden 32, vocabulary 100) in eval mode: GPT-2 and Llama
    as causal LMs (Llama with untied embeddings), BERT bare."""
    torch.manual_seed(seed)
    shared = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    if arch == "gpt2":
        cfg = GPT2Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=4, n_positions=64, **shared)
        return GPT2LMHeadModel(cfg).eval()
    if arch == "llama":
        cfg = LlamaConfig(
            num_hidden_layers=LAYERS,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            **shared,
        )
        return LlamaForCausalLM(cfg).eval()
    if arch == "bert":
        cfg = BertConfig(
            num_hidden_layers=LAYERS,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_attention_heads=4,
            max_position_embeddings=64,
            vocab_size=VOCAB,
            pad_token_id=0,
        )
        return BertModel(cfg).eval()
    raise ValueError(f"arch={arch!r} is unknown; allowed: {', '.join(ARCHS)}")


def head_config(kind: str, i: int) -> HeadConfig:
    """Head ``i`` of a kind in ``KINDS``, on the last layer; heads of one kind share a target."""
    if kind == "sequence_ce":
        return HeadConfig(
            f"h{i}", num_outputs=3, pred_for_sequence=True, pooling="mean", target="y"
        )
    if kind == "token_ce":
        return HeadConfig(f"h{i}", num_outputs=3, target="t")
    if kind == "regression_mse":
        return HeadConfig(
            f"h{i}",
            num_outputs=1,
            pred_for_sequence=True,
            pooling="mean",
            is_regression=True,
            loss_fct="mse",
            target="r",
        )
    raise ValueError(f"kind={kind!r} is unknown; allowed: {', '.join(KINDS)}")


def batch() -> dict[str, torch.Tensor]:
    """A right-padded batch of 2 x 8 with labels of every kind."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 2 :] = 0
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "y": torch.randint(0, 3, (BATCH,), generator=g),
        "t": torch.randint(0, 3, (BATCH, SEQ), generator=g),
        "r": torch.randn(BATCH, generator=g),
    }


# ---------------------------------------------------------------------- train steps
def train_step_ops(arch: str, kind: str, n_heads: int) -> collections.Counter[str]:
    """The operations of one frozen train step (forward with labels, backward; gradients
    start at None, as after ``zero_grad()``) with ``n_heads`` heads of ``kind``."""
    model = HeadedModel(build_model(arch), [head_config(kind, i) for i in range(n_heads)])
    model.train()
    for head in model.heads.values():  # alone, as on a GPU (see the module docstring)
        head.output_projection().register_forward_hook(lambda module, args, out: None)
    target = head_config(kind, 0).target
    data = batch()
    inputs = {k: data[k] for k in ("input_ids", "attention_mask", target)}

    def step() -> None:
        model(**inputs).loss.backward()

    step()  # a first step: anything done once per model (hooks, caches) is not counted
    model.zero_grad(set_to_none=True)
    return count_ops(step)


def per_extra_head(arch: str, kind: str, n_heads: int = 5) -> dict[str, Any]:
    """Operations each head beyond the first adds to a frozen train step: (ops with
    ``n_heads`` - ops with 1) / (``n_heads`` - 1), and which operations they are; and each
    head beyond ``n_heads`` (``per_stacked_head``: the heads' shared loss call is paid)."""
    one, many = train_step_ops(arch, kind, 1), train_step_ops(arch, kind, n_heads)
    more = train_step_ops(arch, kind, 2 * n_heads)
    extra = {k: (many[k] - one[k]) / (n_heads - 1) for k in many | one if many[k] != one[k]}
    return {
        "per_extra_head": (sum(many.values()) - sum(one.values())) / (n_heads - 1),
        "per_stacked_head": (sum(more.values()) - sum(many.values())) / n_heads,
        "one_head": sum(one.values()),
        "host_reads_per_extra_head": extra.get(HOST_READ, 0.0),
        "extra_ops": dict(sorted(extra.items())),
    }


# ---------------------------------------------------------------------- decode steps
def prompts() -> dict[str, torch.Tensor]:
    """Two left-padded prompts of 6 positions."""
    ids = torch.randint(3, VOCAB, (BATCH, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(BATCH, 6, dtype=torch.long)
    mask[1, :2] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 2), "attention_mask": mask}


def headed_for_generation(hf: PreTrainedModel) -> HeadedModel:
    """``hf`` with its frozen ``lm_head`` and a value head (one Linear) on the last layer."""
    heads = [
        HeadConfig("lm_head", is_causal_lm=True, trainable=False),
        HeadConfig("value", num_outputs=1, is_regression=True, loss_fct="mse"),
    ]
    return HeadedModel(hf, heads).eval()


def decode_step_ops(arch: str, first: int = 4, more: int = 8) -> dict[str, Any]:
    """Operations of one greedy decode step: the backbone's own ``generate`` and
    HeadedModel's (frozen ``lm_head`` + a value head), each the count for ``first + more``
    new tokens minus that for ``first``, over ``more``; the goal allows the heads' own
    matmuls (the value head's, per step) on top of ``MAX_DECODE_STEP_FACTOR`` x the backbone's."""
    hf = build_model(arch)
    headed = headed_for_generation(hf)
    data = prompts()
    # no eos: every call makes all its tokens
    settings = {"do_sample": False, "eos_token_id": None, "pad_token_id": 2}

    def ops(generate: Callable[..., Any], n: int) -> collections.Counter[str]:
        with torch.inference_mode():
            generate(**data, max_new_tokens=n, **settings)  # warm
            return count_ops(lambda: generate(**data, max_new_tokens=n, **settings))

    def step(generate: Callable[..., Any]) -> tuple[float, collections.Counter[str]]:
        a, b = ops(generate, first), ops(generate, first + more)
        return (sum(b.values()) - sum(a.values())) / more, b - a

    backbone, b_ops = step(hf.generate)
    heads, h_ops = step(headed.generate)
    head_matmuls = sum(len(head.linears) for n, head in headed.heads.items() if n != "lm_head")
    allowed = MAX_DECODE_STEP_FACTOR * backbone + head_matmuls
    extra = {k: (h_ops[k] - b_ops[k]) / more for k in h_ops | b_ops if h_ops[k] != b_ops[k]}
    return {
        "backbone": backbone,
        "headed": heads,
        "head_matmuls": head_matmuls,
        "allowed": allowed,
        "ratio": heads / backbone,
        "ratio_less_head_matmuls": (heads - head_matmuls) / backbone,
        "extra_ops": dict(sorted(extra.items())),
    }
