"""The losses of many heads at once: what does not depend on the head is done once.

``head_losses`` gives each head with a loss and a label exactly what ``head_loss`` would give
it alone, bit for bit, but:

- heads that read one target with the same label rule, mask and prediction shape share one
  ``count_labels`` (its checks, masks and the count of what counts);
- among those, heads with the same loss and options whose ``LossSpec`` is ``stackable``
  (built-in: cross_entropy, mse, masked_mse, l1, smooth_l1) run their loss as one call on
  their predictions laid end to end (``stacked_losses``), so an extra head adds its own
  Linear and nothing else per step: on the CPU the per-row kernels wake the worker threads
  once per batch instead of once per head, on a GPU they launch once.

Why that is exact. A stackable loss computes each row from that row alone, and the same way
wherever the row lies: ``-``, ``*`` and ``abs`` element-wise (exactly rounded, so a vector
lane and the scalar tail agree), and cross-entropy's ``log_softmax``, whose kernels run each
row on its own from its first element. Each head's slice starts on a 256-byte boundary, as
its own allocation would (``ALIGN_ROWS``): each head's mean is the ``sum`` of one contiguous,
aligned row of the length it had alone (a sum over a dimension may add in another order, so
it is not used), and the gradients that reach each head's Linear are aligned slices too, so
kernels that choose their path by alignment choose as before. Losses with element-wise
``exp``/``log`` (``bce``, ``bce_with_logits``, ``focal``) are not stackable: where a row
lies decides whether a value goes through a vector lane or the scalar tail, which may round
differently. Heads with ``class_weights``, ``pos_weight`` or a causal shift compute alone,
and so do those ``head_losses``' ``stack`` leaves out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

import torch

from .objective import (
    IGNORE_INDEX,
    LOSSES,
    CountedLabels,
    LossSpec,
    count_labels,
    counted_loss,
    head_loss,
    label_rule,
    loss_options,
)

if TYPE_CHECKING:
    from ..config import HeadConfig

#: Each head's rows start at a multiple of this many rows (of at least 2 bytes each): 256
#: bytes, the largest alignment by which CUDA kernels (cuBLAS, reductions) pick a path.
ALIGN_ROWS = 128


def head_losses(
    configs: Mapping[str, HeadConfig],
    preds: Mapping[str, torch.Tensor],
    labels: Mapping[str, Any],
    masks: Mapping[str, torch.Tensor | None],
    check: bool = True,
    stack: bool | AbstractSet[str] = True,
) -> dict[str, torch.Tensor]:
    """``head_loss`` of every head that has a loss and a label (``labels`` by target,
    ``masks`` by head), in ``configs``' order: labels counted once for all the heads that
    read them alike, and (``stack``) the losses of stackable heads computed as one call.

    ``stack``: which heads may share a call (True: any; a set: those named). A head computes
    alone where the order of gradients matters or a gradient must not flow:

    - heads whose inputs need a gradient (a trainable backbone, learned pooling): their
      gradients are summed into the shared input in the order the autograd engine runs the
      heads' nodes; on GPT-2, BERT and Llama that order came out the same, but nothing here
      controls it, so such heads keep the graph they had;
    - under ``nonfinite_loss="skip"``, a loss left out of the total must send nothing back
      into its head; in one call the other heads' zero gradient for its rows becomes NaN
      there (``log_softmax``'s backward of a NaN row).

    ``HeadedModel.forward`` passes the heads whose inputs need no gradient, under "raise".
    """
    counted: dict[tuple, CountedLabels] = {}
    groups: dict[tuple, list[str]] = {}
    out: dict[str, torch.Tensor | None] = {}
    for name, cfg in configs.items():
        y = labels.get(cfg.target)
        if y is None or cfg.loss_fct is None:
            continue
        p, mask, spec = preds[name], masks.get(name), LOSSES.get(cfg.loss_fct)
        if spec.pairwise:  # rows read as pairs: nothing to count
            out[name] = head_loss(cfg, p, y, mask, check)
            continue
        key = _sharing_key(cfg, spec, p, mask, check)
        labelled = counted.get(key)
        if labelled is None:
            labelled = counted[key] = count_labels(cfg, p, y, mask, check)
        out[name] = None  # keeps the order; filled below
        may = stack is True or (stack is not False and name in stack)
        alone = _stacking_key(cfg, spec, p, labelled) if may else (name,)
        groups.setdefault((key, *alone), []).append(name)
    for (key, *_), names in groups.items():
        if len(names) == 1:
            out[names[0]] = counted_loss(configs[names[0]], preds[names[0]], counted[key])
        else:
            stacked = stacked_losses(configs[names[0]], [preds[n] for n in names], counted[key])
            out.update(zip(names, stacked))
    return out  # type: ignore[return-value]


def _sharing_key(
    cfg: HeadConfig, spec: LossSpec, preds: torch.Tensor, mask: Any, check: bool
) -> tuple:
    """What ``count_labels`` depends on besides the labels of ``cfg.target``: heads with equal
    keys get the same ``CountedLabels`` (the mask by identity: one object per stack)."""
    rule = label_rule(cfg)
    pads = cfg.ignore_pads if rule.skips_padding else None
    shape = (tuple(preds.shape), preds.device)
    return (cfg.target, id(mask), rule, pads, shape, spec.target_range, check)


def _stacking_key(
    cfg: HeadConfig, spec: LossSpec, preds: torch.Tensor, counted: CountedLabels
) -> tuple:
    """Besides the counted labels, what must be equal for heads to share one loss call
    (``stacked_losses``); a head that computes alone gets its own name in the key."""
    own_terms = cfg.class_weights is not None or cfg.pos_weight is not None
    if not spec.stackable or own_terms or counted.shift:
        return (cfg.name,)
    options = loss_options(cfg) if spec.options or cfg.loss_options else {}
    return (id(spec), repr(sorted(options.items())), preds.dtype)  # values may be lists


def stacked_losses(
    cfg: HeadConfig, preds: Sequence[torch.Tensor], counted: CountedLabels
) -> tuple[torch.Tensor, ...]:
    """The losses of heads configured as ``cfg`` (one stackable loss, no class weights, no
    shift) with predictions ``preds`` of one shape and dtype, all reading ``counted``: one
    loss call on their rows laid end to end, each head's rows padded to ``ALIGN_ROWS``.
    Equal, bit for bit, to ``counted_loss`` head by head, and so are the gradients."""
    spec: LossSpec = LOSSES.get(cfg.loss_fct)
    width = preds[0].shape[-1] if spec.classes else 1  # a class loss reads rows of logits
    rows = preds[0].numel() // width
    padded = -(-rows // ALIGN_ROWS) * ALIGN_ROWS
    pad = preds[0].new_zeros(padded - rows, width) if padded > rows else None
    pieces = [q for p in preds for q in (p.reshape(rows, width), pad) if q is not None]
    laid = torch.cat(pieces).float()  # (heads * padded, width); cat's gradient: aligned views
    n = len(preds)
    target = counted.target.reshape(-1)
    if spec.classes:
        target = _padded(target, padded, IGNORE_INDEX).repeat(n)
        per = spec.fn(laid, target, **loss_options(cfg)).view(n, padded)
    else:
        target = _padded(target, padded, 0).expand(n, padded)
        per = spec.fn(laid.view(n, padded), target, **loss_options(cfg))
    if counted.counts is not None and not (spec.classes and spec.zeroes_ignored):
        per = per.masked_fill(_padded(counted.skipped(), padded, True), 0)
    return tuple((_RowSums.apply(per[:, :rows]) / counted.total).unbind())


def _padded(x: torch.Tensor, length: int, value: Any) -> torch.Tensor:
    """``x`` (1-D) followed by ``value`` up to ``length``."""
    if len(x) == length:
        return x
    return torch.cat([x, x.new_full((length - len(x),), value)])


class _RowSums(torch.autograd.Function):
    """(heads, n) → (heads,): each row's ``sum()``, the call each head makes alone (a sum
    over a dimension may add in another order); the gradient is each row's expand, as
    ``sum``'s is."""

    @staticmethod
    def forward(ctx: Any, per: torch.Tensor) -> torch.Tensor:
        ctx.width = per.shape[1]
        return torch.stack([row.sum() for row in per])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad[:, None].expand(-1, ctx.width)
