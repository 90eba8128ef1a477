"""Loss registry and the per-head loss computation (label checks, masking, shifting).

A loss is a ``LossSpec``: an element-wise function with ``reduction="none"`` semantics plus
how it reads labels. The label value -100 is ignored wherever it cannot be a real label
(class indices, binary targets, and ``masked_mse``); plain ``mse``/``l1``/``smooth_l1``
keep every regression value, as in transformer-heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .errors import BatchError
from .registry import Registry

if TYPE_CHECKING:
    from .config import HeadConfig

IGNORE_INDEX = -100


@dataclass(frozen=True)
class LossSpec:
    """``fn(preds, labels) -> per-element loss``.

    ``classes=True``: preds (N, C) logits, labels (N,) integer class indices.
    ``classes=False``: preds (N, n), labels (N, n) floats (a (N,) label is read as (N, 1)).
    ``ignores_minus_100``: label elements equal to -100 contribute nothing.
    """

    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    classes: bool = False
    ignores_minus_100: bool = False


LOSSES: Registry = Registry("loss", "loss_fct")
LOSSES.register(
    "cross_entropy",
    LossSpec(
        lambda p, y: F.cross_entropy(p, y, reduction="none", ignore_index=IGNORE_INDEX),
        classes=True,
        ignores_minus_100=True,
    ),
)
LOSSES.register("mse", LossSpec(lambda p, y: F.mse_loss(p, y, reduction="none")))
LOSSES.register(
    "masked_mse", LossSpec(lambda p, y: F.mse_loss(p, y, reduction="none"), ignores_minus_100=True)
)
LOSSES.register("l1", LossSpec(lambda p, y: F.l1_loss(p, y, reduction="none")))
LOSSES.register("smooth_l1", LossSpec(lambda p, y: F.smooth_l1_loss(p, y, reduction="none")))
LOSSES.register(
    "bce",
    LossSpec(lambda p, y: F.binary_cross_entropy(p, y, reduction="none"), ignores_minus_100=True),
)
LOSSES.register(
    "bce_with_logits",
    LossSpec(
        lambda p, y: F.binary_cross_entropy_with_logits(p, y, reduction="none"),
        ignores_minus_100=True,
    ),
)
#: Losses that take class indices; they cannot train a regression head.
CLASSIFICATION_LOSSES = frozenset({"cross_entropy"})
#: Losses that need probabilities in [0, 1] (the head's output_activation must give them).
PROBABILITY_LOSSES = frozenset({"bce"})


def _head(cfg: HeadConfig) -> str:
    return f"head {cfg.name!r} (target {cfg.target!r})"


def head_loss(
    cfg: HeadConfig,
    preds: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Validate ``labels`` for this head and return its scalar loss.

    preds: (batch, n) for sequence heads, (batch, seq, n) otherwise.
    Positions excluded by padding (``ignore_pads``) or by -100 do not count; when nothing
    counts the loss is an exact zero that still belongs to the graph.
    """
    spec: LossSpec = LOSSES.get(cfg.loss_fct)
    labels = labels_as_tensor(labels, preds.device, _head(cfg))
    batch = preds.shape[0]
    n_out = preds.shape[-1]
    if labels.dim() == 0 or labels.shape[0] != batch:
        raise BatchError(
            f"{_head(cfg)}: labels of shape {tuple(labels.shape)} do not match the batch size "
            f"{batch}"
        )
    # ---- shapes: bring labels to preds' leading dims
    lead = preds.shape[:-1]  # (batch,) or (batch, seq)
    kind = "sequence" if cfg.pred_for_sequence else "token"
    if spec.classes:
        expected = [tuple(lead)]
    else:
        expected = [tuple(lead) + (n_out,)] + ([tuple(lead)] if n_out == 1 else [])
    if tuple(labels.shape) not in expected:
        hint = ""
        if cfg.pred_for_sequence and labels.dim() >= 2 and labels.shape[1] != n_out:
            hint = " (token-level labels given to a sequence head?)"
        elif not cfg.pred_for_sequence and labels.dim() == 1:
            hint = " (one label per sequence given to a token head? set pred_for_sequence=True)"
        elif not cfg.pred_for_sequence and labels.dim() >= 2 and labels.shape[1] != lead[1]:
            hint = f" (label sequence length {labels.shape[1]} != input length {lead[1]})"
        raise BatchError(
            f"{_head(cfg)} is a {kind} head: labels of shape {tuple(labels.shape)} do not fit; "
            f"expected {' or '.join(str(e) for e in expected)}{hint}"
        )
    if not spec.classes and labels.dim() == len(lead):
        labels = labels.unsqueeze(-1)

    # ---- which positions count: (batch,) or (batch, seq)
    valid = torch.ones(lead, dtype=torch.bool, device=preds.device)
    if not cfg.pred_for_sequence and cfg.ignore_pads and attention_mask is not None:
        valid = attention_mask.to(preds.device).bool().clone()
    if cfg.is_causal_lm:  # position t predicts token t+1
        preds, labels, valid = preds[:, :-1], labels[:, 1:], valid[:, 1:]

    if spec.classes:
        if labels.dtype.is_floating_point or labels.dtype == torch.bool:
            raise BatchError(
                f"{_head(cfg)}: loss_fct={cfg.loss_fct!r} needs integer class indices, got "
                f"labels of dtype {labels.dtype}"
            )
        labels = labels.long()
        valid = valid & (labels != IGNORE_INDEX)
        bad = valid & ((labels < 0) | (labels >= n_out))
        if bool(bad.any()):
            value = int(labels[bad][0])
            raise BatchError(
                f"{_head(cfg)}: class index {value} is out of range for num_outputs={n_out}; "
                f"allowed: 0..{n_out - 1} (or {IGNORE_INDEX} to ignore)"
            )
        target = torch.where(valid, labels, IGNORE_INDEX)
        per = spec.fn(preds.reshape(-1, n_out).float(), target.reshape(-1))
        weights = valid.reshape(-1).to(per.dtype)
    else:
        if not (labels.dtype.is_floating_point or labels.dtype in _NUMERIC):
            raise BatchError(
                f"{_head(cfg)}: loss_fct={cfg.loss_fct!r} needs numeric labels, got {labels.dtype}"
            )
        labels = labels.to(torch.float32)
        elem_valid = valid.unsqueeze(-1).expand_as(labels)
        if spec.ignores_minus_100:
            elem_valid = elem_valid & (labels != IGNORE_INDEX)
        finite = torch.isfinite(labels)
        if bool((elem_valid & ~finite).any()):
            raise BatchError(
                f"{_head(cfg)}: labels contain NaN or infinite values at positions that count; "
                "regression labels must be finite"
            )
        if cfg.loss_fct.lower() in PROBABILITY_LOSSES | {"bce_with_logits"}:  # names: any case
            outside = elem_valid & ((labels < 0) | (labels > 1))
            if bool(outside.any()):
                raise BatchError(
                    f"{_head(cfg)}: loss_fct={cfg.loss_fct!r} needs targets in [0, 1], got "
                    f"{float(labels[outside][0])}"
                )
        safe = torch.where(elem_valid, labels, torch.zeros_like(labels))
        p = preds.float()
        per = spec.fn(p, safe).reshape(-1)
        weights = elem_valid.reshape(-1).to(per.dtype)
    per = torch.where(weights > 0, per, torch.zeros_like(per))
    return per.sum() / weights.sum().clamp(min=1)


_NUMERIC = {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool}


def labels_as_tensor(labels, device, where: str) -> torch.Tensor:
    """``labels`` (tensor, list, array) as a tensor on ``device``; BatchError naming ``where``."""
    if isinstance(labels, torch.Tensor):
        return labels.to(device)
    try:
        return torch.as_tensor(labels, device=device)
    except (TypeError, ValueError, RuntimeError) as e:
        raise BatchError(
            f"{where}: labels of type {type(labels).__name__} cannot become a tensor ({e})"
        ) from None
