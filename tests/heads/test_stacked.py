"""Heads that are one Linear of the same tensor run as one batched matmul on the CPU
(``heads/stacked.py``): each head's output and its weight and bias gradients are, bit for bit,
what ``from_features`` gives it alone on one thread; heads that cannot be stacked exactly
compute alone."""

from __future__ import annotations

import collections
import itertools

import pytest
import torch
from conftest import build_tiny
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from headkit import HeadConfig, HeadedModel
from headkit.heads import MLPHead
from headkit.heads.stacked import head_outputs

pytestmark = pytest.mark.usefixtures("single_thread")


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _heads(n: int, width: int, outputs: int, **kw) -> dict[str, MLPHead]:
    torch.manual_seed(n * 1000 + width + outputs)
    return {
        f"h{i}": MLPHead(HeadConfig(f"h{i}", in_size=width, num_outputs=outputs, **kw))
        for i in range(n)
    }


def _run(heads, x, grads, stack: bool):
    """Outputs, then each parameter's gradient after backward of sum(out_i * grads_i)."""
    for p in (p for h in heads.values() for p in h.parameters()):
        p.grad = None
    ops = _Ops()
    with ops:
        outs = head_outputs(heads, dict.fromkeys(heads, x), stack=stack)
        total = sum((outs[n] * g).sum() for n, g in grads.items())
        total.backward()
    params = {f"{n}.{k}": p.grad for n, h in heads.items() for k, p in h.named_parameters()}
    return outs, params, ops.seen


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        if want[k] is None:
            assert got[k] is None, k
        else:
            assert torch.equal(got[k], want[k]), k


def test_stacked_heads_equal_each_head_alone_bit_for_bit_over_many_shapes() -> None:
    shapes = itertools.product(
        [(1,), (2,), (8,), (64,), (1000,), (2, 7), (8, 128), (4, 33)],  # rows (and positions)
        [16, 64, 256, 1024],  # in_size
        [2, 3, 5, 17, 64],  # num_outputs
        [False, True],  # output_bias
    )
    stacked = 0
    for lead, width, outputs, bias in shapes:
        heads = _heads(3, width, outputs, output_bias=bias)
        x = torch.randn(*lead, width)
        grads = {n: torch.randn(*lead, outputs) for n in heads}
        want_out, want_grads, alone = _run(heads, x, grads, stack=False)
        got_out, got_grads, ops = _run(heads, x, grads, stack=True)
        _assert_equal(got_out, want_out)
        _assert_equal(got_grads, want_grads)
        assert "bmm" not in alone
        if x.numel() * outputs >= 400:  # smaller: bmm would take its own loop, so alone
            assert ops["bmm"] + ops["baddbmm"] == 2, (lead, width, outputs, bias)
            assert "mm" not in ops and "addmm" not in ops, (lead, width, outputs, bias)
            stacked += 1
    assert stacked > 100


@pytest.mark.parametrize("activation", ["sigmoid", "tanh", "softmax"])
def test_the_output_activation_follows_each_stacked_head(activation: str) -> None:
    heads = _heads(4, 32, 3, output_activation=activation)
    x = torch.randn(16, 32)
    grads = {n: torch.randn(16, 3) for n in heads}
    want = _run(heads, x, grads, stack=False)
    got = _run(heads, x, grads, stack=True)
    assert got[2]["bmm"] == 2
    _assert_equal(got[0], want[0])
    _assert_equal(got[1], want[1])


def test_a_head_whose_output_gets_no_gradient_gets_none_as_alone() -> None:
    """An optimizer skips a parameter whose grad is None: a zero gradient instead would move
    it (weight decay, momentum), so an unused head must get None, as it does alone."""
    heads = _heads(4, 32, 3, output_bias=True)
    x = torch.randn(16, 32)
    grads = {"h0": torch.randn(16, 3), "h2": torch.randn(16, 3)}  # h1 and h3 unused
    want = _run(heads, x, grads, stack=False)
    got = _run(heads, x, grads, stack=True)
    assert got[2]["baddbmm"] == 1 and got[2]["bmm"] == 1  # forward with biases, backward
    _assert_equal(got[1], want[1])
    assert got[1]["h1.mlp.0.weight"] is None and got[1]["h3.mlp.0.bias"] is None


def test_a_stacked_head_output_can_be_changed_in_place_and_frozen_heads_stack_too() -> None:
    heads = _heads(3, 32, 4)
    x = torch.randn(16, 32)
    outs = head_outputs(heads, dict.fromkeys(heads, x))
    outs["h0"].mul_(2).sum().backward()  # its own tensor, not a view of the others'
    assert heads["h0"].mlp[0].weight.grad is not None and heads["h1"].mlp[0].weight.grad is None
    for head in heads.values():
        head.requires_grad_(False)
    ops = _Ops()
    with ops:
        frozen = head_outputs(heads, dict.fromkeys(heads, x))
    assert ops.seen["bmm"] == 1
    for name, head in heads.items():
        assert torch.equal(frozen[name], head.from_features(x))


def _alone_cases():
    """(heads, features) that must not be stacked, each with why."""
    x = torch.randn(16, 32)

    def hooked():
        heads = _heads(3, 32, 3)
        heads["h1"].mlp[0].register_forward_hook(lambda m, i, o: None)
        return heads, dict.fromkeys(heads, x), {"h1"}

    def bf16():
        heads = {n: h.to(torch.bfloat16) for n, h in _heads(3, 32, 3).items()}
        return heads, dict.fromkeys(heads, x.bfloat16()), set(heads)

    def needs_grad():
        heads = _heads(3, 32, 3)
        return heads, dict.fromkeys(heads, x.clone().requires_grad_()), set(heads)

    def separate_inputs():
        heads = _heads(3, 32, 3)
        return heads, {n: x.clone() for n in heads}, set(heads)

    return {
        "one output (a matrix-vector kernel)": lambda: (
            (h := _heads(3, 32, 1)),
            dict.fromkeys(h, x),
            set(h),
        ),
        "under 400 multiply-adds": lambda: (
            (h := _heads(3, 4, 2)),
            dict.fromkeys(h, x[:2, :4]),
            set(h),
        ),
        "two layers": lambda: (
            (h := _heads(3, 32, 3, num_layers=2, hidden_size=8)),
            dict.fromkeys(h, x),
            set(h),
        ),
        "dropout": lambda: ((h := _heads(3, 32, 3, dropout=0.1)), dict.fromkeys(h, x), set(h)),
        "a hook on one head's Linear": hooked,
        "bfloat16": bf16,
        "inputs that need a gradient": needs_grad,
        "a tensor per head": separate_inputs,
    }


@pytest.mark.parametrize("case", list(_alone_cases()))
def test_heads_that_cannot_stack_exactly_compute_alone(case: str) -> None:
    heads, features, alone = _alone_cases()[case]()
    for head in heads.values():
        head.eval()  # dropout: the same mask on both sides
    ops = _Ops()
    with ops:
        outs = head_outputs(heads, features)
    for name, head in heads.items():
        assert torch.equal(outs[name], head.from_features(features[name])), name
    stacked = len(heads) - len(alone)
    assert ops.seen["bmm"] == (1 if stacked > 1 else 0), (case, dict(ops.seen))


def test_autocast_and_reduced_precision_matmuls_leave_every_head_alone() -> None:
    heads = _heads(3, 32, 3)
    x = torch.randn(16, 32)
    ops = _Ops()
    with ops, torch.autocast("cpu", dtype=torch.bfloat16):
        head_outputs(heads, dict.fromkeys(heads, x))
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        with ops:
            head_outputs(heads, dict.fromkeys(heads, x))
    finally:
        torch.set_float32_matmul_precision(before)
    assert "bmm" not in ops.seen


class _AllHeads(nn.Module):
    """The heads of ``_heads`` as one module: the sum of every output on ``x``."""

    def __init__(self, heads: dict[str, MLPHead]) -> None:
        super().__init__()
        self.heads = nn.ModuleDict(heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = head_outputs(dict(self.heads.items()), dict.fromkeys(self.heads, x))
        return sum(o.sum() for o in outs.values())


def test_per_sample_gradients_with_torch_func_compute_each_head_alone() -> None:
    """``torch.func.vmap(torch.func.grad(...))`` over the heads (per-sample gradients, as for
    differential privacy) works as it did before heads could be stacked."""
    model = _AllHeads(_heads(3, 256, 3))  # a row alone is past 400 multiply-adds
    x = torch.randn(16, 256)
    batched = torch.func.vmap(model)(x[:, None])  # the heads' own parameters, a batched input
    torch.testing.assert_close(batched, torch.stack([model(r[None]) for r in x]))
    params = {k: p.detach() for k, p in model.named_parameters()}

    def loss(p: dict, row: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (row[None],))

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for name, head in model.heads.items():
        w = head.mlp[0].weight
        want = [torch.autograd.grad(head.from_features(r[None]).sum(), w)[0] for r in x]
        torch.testing.assert_close(per_sample[f"heads.{name}.mlp.0.weight"], torch.stack(want))


def test_forward_mode_ad_computes_each_head_alone() -> None:
    heads = _heads(3, 256, 3)
    x, tangent = torch.randn(16, 256), torch.randn(16, 256)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x, tangent)
        outs = head_outputs(heads, dict.fromkeys(heads, dual))
        for name, head in heads.items():
            got = torch.autograd.forward_ad.unpack_dual(outs[name]).tangent
            torch.testing.assert_close(got, tangent @ head.mlp[0].weight.T)


def _train_step(model: HeadedModel, batch: dict) -> tuple[dict, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {k: p.grad for k, p in model.named_parameters() if p.requires_grad}
    return {**out.preds_by_head, **{f"loss.{k}": v for k, v in out.loss_by_head.items()}}, grads


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_a_headed_model_with_many_heads_trains_exactly_as_with_each_head_alone(arch: str) -> None:
    """Scenario d of the benchmark suite in small: heads on one pooling, a shared target and
    heads without a label in the batch. The reference keeps every head alone: a forward hook
    on each Linear (hooks keep a head out of the stacked matmul)."""
    base = build_tiny(arch, num_layers=2)
    heads = [
        HeadConfig(f"s{i}", num_outputs=3, pred_for_sequence=True, pooling="mean", target="y")
        for i in range(5)
    ] + [
        HeadConfig("r", num_outputs=2, pred_for_sequence=True, pooling="mean", target="z"),
        HeadConfig("t0", num_outputs=4, target="t", output_bias=True),
        HeadConfig("t1", num_outputs=4, target="t", output_bias=True),
    ]
    torch.manual_seed(0)
    model = HeadedModel(base, heads).train()
    ref = HeadedModel(build_tiny(arch, num_layers=2), heads).train()
    ref.load_state_dict(model.state_dict())
    for head in ref.heads.values():
        head.mlp[-1].register_forward_hook(lambda m, i, o: None)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (8, 12), generator=g)
    mask = torch.ones(8, 12, dtype=torch.long)
    mask[2, 7:] = 0
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "y": torch.randint(0, 3, (8,), generator=g),
        "t": torch.randint(0, 4, (8, 12), generator=g),
    }  # no "z": head r gets no loss and no gradient
    ops = _Ops()
    with ops:
        got = _train_step(model, batch)
    want = _train_step(ref, batch)
    assert ops.seen["bmm"] + ops.seen["baddbmm"] >= 4  # sequence heads', token heads' groups
    _assert_equal(got[0], want[0])
    _assert_equal(got[1], want[1])
    assert got[1]["heads.r.mlp.0.weight"] is None


def test_a_trainable_backbone_keeps_every_head_alone() -> None:
    """Inputs that need a gradient: one sum over the heads would add in another order."""
    heads = [
        HeadConfig(f"s{i}", num_outputs=3, pred_for_sequence=True, target="y") for i in range(3)
    ]
    batch = {"input_ids": torch.randint(3, 90, (8, 12)), "y": torch.randint(0, 3, (8,))}
    seen = []
    for hooked in (False, True):
        model = HeadedModel(build_tiny("bert", num_layers=1), heads, freeze_base_model=False)
        for head in model.heads.values() if hooked else ():
            head.mlp[-1].register_forward_hook(lambda m, i, o: None)
        ops = _Ops()
        with ops:
            model.train()(**batch).loss.backward()
        seen.append(ops.seen)
    assert seen[0] == seen[1]
