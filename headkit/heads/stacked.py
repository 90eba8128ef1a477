"""Many heads' outputs at once: same-shape linear heads on one input run as one matmul.

``head_outputs`` gives each head exactly what ``head.from_features`` gives it, but heads that
are one Linear of the same tensor (``Head.linear_form``; the default head with
``num_layers=1``: linear probes, classifiers and regressors on a shared pooling) run as one
batched matmul on the CPU, forward and backward: an extra head then adds no matmul call of
its own. On a CPU every small matmul is one oneMKL call that wakes the worker threads (under
``OMP_WAIT_POLICY=PASSIVE`` that costs about 80 µs on a tiny Linear, 20× its arithmetic),
so 25 heads on a shared pooling cost 48 such calls a step, against 2 stacked.

Why that is exact. ``torch.bmm`` on the CPU runs each matrix of the batch as the oneMKL call
``F.linear`` makes for it alone, with the same layouts (``x @ W.T``, plus the bias as in
``addmm``, forward; ``grad.T @ x`` for the weight's gradient, the orientation autograd picks
for ``F.linear``, and ``grad.sum(0)`` for the bias's). Equal bit for bit on one thread in
every shape tried: 1,018 shapes of 2 to 25 heads (rows 1 to 1,024, widths 16 to 1,024, 2 to 64
outputs, with and without bias, 2-D and 3-D inputs), and the 292 of
``tests/heads/test_stacked.py``. A lone matmul on several threads may split its
work by shape and change the last bit of some weight gradients (oneMKL: 41 of 254 shapes
differ between 1 and 2 threads); the batched call gives the one-thread result whatever the
thread count. Heads stay alone where that is not shown:

- one output (``num_outputs=1``): ``F.linear`` takes a matrix-vector kernel then, which
  rounds otherwise;
- a matmul under 400 multiply-adds, where ``bmm`` switches to its own loop;
- inputs that need a gradient (a trainable backbone): their gradient would be one sum over
  the heads instead of one per head, added in another order;
- other dtypes or devices than float32 on the CPU, autocast, reduced-precision float32
  matmuls, ``torch.compile``, tracing, ``torch.func`` and forward-mode AD, and Linears with hooks
  or that are not a plain ``nn.Linear`` with plain parameters (peft's layers, FSDP's sharded
  parameters, quantized weights).

A head whose output gets no gradient gets none for its weights either (``None``, as alone).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module

from ..modules import has_hooks
from .base import Head

#: Below this many multiply-adds ``torch.bmm`` on the CPU uses its own loop, not oneMKL.
MIN_STACKED_MACS = 400


def head_outputs(
    heads: Mapping[str, nn.Module], features: Mapping[str, torch.Tensor], stack: bool = True
) -> dict[str, torch.Tensor]:
    """Each head's ``from_features(features[name])``, in ``heads``' order; with ``stack``,
    heads that are one Linear of the same tensor run as one batched matmul where that is
    exact (see the module docstring)."""
    groups: dict[tuple, dict[str, tuple]] = {}
    if stack and len(heads) > 1 and _may_stack():  # one head: nothing to stack
        for name, head in heads.items():
            form = head.linear_form() if isinstance(head, Head) else None
            key = _stacking_key(form, features[name]) if form is not None else None
            if key is not None:
                groups.setdefault(key, {})[name] = form
    preds: dict[str, torch.Tensor] = {}
    for forms in groups.values():
        if len(forms) > 1:
            x = features[next(iter(forms))]
            preds.update(zip(forms, _stacked(list(forms.values()), x)))
    return {n: preds[n] if n in preds else h.from_features(features[n]) for n, h in heads.items()}


def _may_stack() -> bool:
    """What no head decides: no compiler, tracer, ``torch.func`` transform, forward-mode AD,
    autocast, reduced-precision matmuls or global module hooks."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    if torch._C._are_functorch_transforms_active():  # vmap, grad: a Function needs more there
        return False
    if torch.autograd.forward_ad._current_level >= 0:  # forward-mode AD: it would need a jvp
        return False
    if torch.is_autocast_enabled("cpu") or torch.get_float32_matmul_precision() != "highest":
        return False
    mkldnn = getattr(torch.backends.mkldnn, "matmul", None)
    if getattr(mkldnn, "fp32_precision", "none") not in ("none", "ieee"):
        return False
    return not (
        _module._global_forward_hooks
        or _module._global_forward_pre_hooks
        or _module._global_backward_hooks
        or _module._global_backward_pre_hooks
        or _module._global_forward_hooks_always_called
    )


def _stacking_key(form: tuple[nn.Linear, Any], x: torch.Tensor) -> tuple | None:
    """What heads of ``linear_form()`` ``form`` must share to run as one matmul on ``x``;
    None: this head runs alone."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.requires_grad:
        return None
    linear, _ = form
    w, b = linear.weight, linear.bias
    if type(linear) is not nn.Linear or has_hooks(linear) or type(w) is not nn.Parameter:
        return None
    if w.dtype != torch.float32 or w.device.type != "cpu" or x.shape[-1] != w.shape[1]:
        return None
    if x.dim() < 2 or (x.dim() > 2 and not x.is_contiguous()):  # a vector: F.linear's mv;
        return None  # a strided batch of rows: F.linear adds the bias apart
    if b is not None and (type(b) is not nn.Parameter or b.dtype != torch.float32):
        return None
    outputs = w.shape[0]
    if outputs < 2 or x.numel() * outputs < MIN_STACKED_MACS:
        return None
    grads = (w.requires_grad, b is not None and b.requires_grad)
    return (id(x), tuple(w.shape), b is not None, grads)


def _stacked(forms: list[tuple[nn.Linear, Any]], x: torch.Tensor) -> list[torch.Tensor]:
    """The outputs on ``x`` of heads of ``linear_form()`` ``forms`` (keyed alike)."""
    weights = [lin.weight for lin, _ in forms]
    biases = [lin.bias for lin, _ in forms if lin.bias is not None]
    outs = _StackedLinear.apply(x, len(forms), *weights, *biases)
    return [out if act is None else act(out) for out, (_, act) in zip(outs, forms)]


class _StackedLinear(torch.autograd.Function):
    """``F.linear(x, W_i, b_i)`` for n heads as one ``bmm`` (``baddbmm`` with biases), and
    the weights' gradients as one ``bmm`` in the orientation autograd uses for ``F.linear``
    (``grad.T @ x``); the biases' are ``grad.sum(0)`` per head."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, n: int, *params: torch.Tensor) -> tuple:
        ctx.set_materialize_grads(False)  # an unused output: None, and None for its weights
        weights, biases = params[:n], params[n:]
        lead, rows = x.shape[:-1], x.reshape(-1, x.shape[-1])  # F.linear folds them alike
        stacked = rows.expand(n, *rows.shape)
        w = torch.stack(weights).transpose(1, 2)
        if biases:
            y = torch.baddbmm(torch.stack(biases).unsqueeze(1), stacked, w)
        else:
            y = torch.bmm(stacked, w)
        ctx.save_for_backward(rows)
        ctx.n = n
        # own tensors, not views of y: a head's output may be modified in place, as alone
        return tuple(out.view(*lead, out.shape[-1]).clone() for out in y.unbind(0))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        (rows,) = ctx.saved_tensors
        n, needs = ctx.n, ctx.needs_input_grad
        out: list[torch.Tensor | None] = [None] * len(needs)
        used = [i for i, g in enumerate(grads) if g is not None]
        if not used:
            return tuple(out)
        g = torch.stack([grads[i].reshape(-1, grads[i].shape[-1]) for i in used])
        if any(needs[2 + i] for i in used):
            gw = torch.bmm(g.transpose(1, 2), rows.expand(len(used), *rows.shape))
            for j, i in enumerate(used):
                out[2 + i] = gw[j] if needs[2 + i] else None
        if len(needs) > 2 + n and any(needs[2 + n + i] for i in used):
            gb = g.sum(1)
            for j, i in enumerate(used):
                out[2 + n + i] = gb[j] if needs[2 + n + i] else None
        return tuple(out)
