"""A head's objective in one place: the loss registry, what each loss needs, which positions count.

A loss is a ``LossSpec``: an element-wise function (``reduction="none"`` semantics) plus every
property anything else asks about — how it reads labels (class indices or values), what -100
means to it, the target range, whether it needs probabilities, which metrics fit it and the
decision threshold. Validation (``HeadConfig``), the loss (``head_loss``), the metrics, the
collator and feature caching all ask the spec, so a loss registered by a user behaves like a
built-in one. Names are looked up case-insensitively (``LOSSES.get``), once.

Which positions count is one rule (``counted_positions``): padding does not count for token
heads with ``ignore_pads``, and a causal-LM head's prediction at t is scored against the label
at t + 1. The label value -100 marks a position to ignore: losses that can ignore it
(``ignores_minus_100``: class indices, binary targets, ``masked_mse``) skip it; losses for
which it would be a real value (``mse``, ``l1``, ``smooth_l1``) refuse it with a BatchError
rather than train towards -100 (use ``masked_mse``). Metrics skip it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..errors import BatchError
from ..registry import Registry

if TYPE_CHECKING:
    from ..config import HeadConfig

IGNORE_INDEX = -100


@dataclass(frozen=True)
class LossSpec:
    """``fn(preds, labels) -> per-element loss`` and what it needs.

    ``classes=True``: preds (N, C) logits, labels (N,) integer class indices.
    ``classes=False``: preds (N, n), labels (N, n) floats (a (N,) label is read as (N, 1)).
    ``ignores_minus_100``: label elements equal to -100 contribute nothing (otherwise -100 at
    a position that counts is refused). ``target_range``: allowed label values, inclusive.
    ``needs_probabilities``: predictions must be in [0, 1] (the head's output activation must
    give them). ``metric``: "classification", "binary" or "regression" (which metrics fit;
    default from ``classes``). ``threshold``: the decision threshold of binary predictions.
    """

    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    classes: bool = False
    ignores_minus_100: bool = False
    target_range: tuple[float, float] | None = None
    needs_probabilities: bool = False
    metric: str | None = None
    threshold: float | None = None

    def __post_init__(self) -> None:
        if self.metric is None:
            object.__setattr__(self, "metric", "classification" if self.classes else "regression")
        if self.metric not in ("classification", "binary", "regression"):
            raise ValueError(
                f"LossSpec: metric={self.metric!r} is invalid; 'classification', 'binary' or "
                "'regression'"
            )
        if self.metric == "binary" and self.threshold is None:
            object.__setattr__(self, "threshold", 0.5 if self.needs_probabilities else 0.0)


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
    LossSpec(
        lambda p, y: F.binary_cross_entropy(p, y, reduction="none"),
        ignores_minus_100=True,
        target_range=(0.0, 1.0),
        needs_probabilities=True,
        metric="binary",
    ),
)
LOSSES.register(
    "bce_with_logits",
    LossSpec(
        lambda p, y: F.binary_cross_entropy_with_logits(p, y, reduction="none"),
        ignores_minus_100=True,
        target_range=(0.0, 1.0),
        metric="binary",
    ),
)


class _LossNames:
    """A live set of the registered loss names with one property (any case)."""

    def __init__(self, prop: Callable[[LossSpec], bool]) -> None:
        self._prop = prop

    def __contains__(self, name: object) -> bool:
        return name in LOSSES and self._prop(LOSSES.get(name))  # type: ignore[arg-type]

    def __iter__(self):
        return iter([n for n in LOSSES.names() if self._prop(LOSSES.get(n))])


#: Losses that take class indices (registered ones included); they cannot train a regression head.
CLASSIFICATION_LOSSES = _LossNames(lambda s: s.classes)
#: Losses that need probabilities in [0, 1] (the head's output_activation must give them).
PROBABILITY_LOSSES = _LossNames(lambda s: s.needs_probabilities)


def loss_spec(cfg: HeadConfig) -> LossSpec | None:
    """The head's LossSpec, or None for a head without a loss."""
    return None if cfg.loss_fct is None else LOSSES.get(cfg.loss_fct)


def task_of(cfg: HeadConfig) -> str:
    """ "lm", "regression", "binary" or "classification": which metrics the head gets."""
    if cfg.is_causal_lm:
        return "lm"
    if cfg.is_regression:
        return "regression"
    spec = loss_spec(cfg)
    return spec.metric if spec is not None else "classification"  # type: ignore[return-value]


def takes_class_indices(cfg: HeadConfig) -> bool:
    """Whether the head's labels are class indices (one integer per position)."""
    spec = loss_spec(cfg)
    if spec is not None:
        return spec.classes
    return task_of(cfg) in ("classification", "lm")


def minus_100_is_ignored(cfg: HeadConfig) -> bool:
    """Whether a -100 label is skipped by the head's loss (a loss-free head: always)."""
    spec = loss_spec(cfg)
    return spec is None or spec.ignores_minus_100


def _where(cfg: HeadConfig) -> str:
    return f"head {cfg.name!r} (target {cfg.target!r})"


# ---------------------------------------------------------------------- positions
def fit_labels(cfg: HeadConfig, preds: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Check ``labels`` against the head's predictions and bring them to their layout.

    Class indices: preds' leading shape, (batch,) or (batch, seq). Values: preds' shape
    (a label without the last dimension is accepted when num_outputs is 1).
    """
    batch = preds.shape[0]
    n_out = preds.shape[-1]
    if labels.dim() == 0 or labels.shape[0] != batch:
        raise BatchError(
            f"{_where(cfg)}: labels of shape {tuple(labels.shape)} do not match the batch size "
            f"{batch}"
        )
    lead = tuple(preds.shape[:-1])  # (batch,) or (batch, seq)
    classes = takes_class_indices(cfg)
    expected = [lead] if classes else [lead + (n_out,)] + ([lead] if n_out == 1 else [])
    if tuple(labels.shape) not in expected:
        hint = ""
        if cfg.pred_for_sequence and labels.dim() >= 2 and labels.shape[1] != n_out:
            hint = " (token-level labels given to a sequence head?)"
        elif not cfg.pred_for_sequence and labels.dim() == 1:
            hint = " (one label per sequence given to a token head? set pred_for_sequence=True)"
        elif not cfg.pred_for_sequence and labels.dim() >= 2 and labels.shape[1] != lead[1]:
            hint = f" (label sequence length {labels.shape[1]} != input length {lead[1]})"
        kind = "sequence" if cfg.pred_for_sequence else "token"
        raise BatchError(
            f"{_where(cfg)} is a {kind} head: labels of shape {tuple(labels.shape)} do not fit; "
            f"expected {' or '.join(str(e) for e in expected)}{hint}"
        )
    if not classes and labels.dim() == len(lead):
        labels = labels.unsqueeze(-1)
    return labels


def counted_positions(
    cfg: HeadConfig, preds: torch.Tensor, labels: torch.Tensor, attention_mask: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one rule for which positions count: returns ``(preds, labels, valid)``.

    ``valid`` has preds' leading shape after alignment. Padding (mask 0) does not count for
    token heads with ``ignore_pads``; a causal-LM head's prediction at t meets the label at
    t + 1 (preds lose the last position, labels and ``valid`` the first). -100 is not handled
    here: see ``head_loss`` and the metrics.
    """
    lead = preds.shape[:-1]
    valid = torch.ones(lead, dtype=torch.bool, device=preds.device)
    if not cfg.pred_for_sequence and cfg.ignore_pads and attention_mask is not None:
        mask = torch.as_tensor(attention_mask, device=preds.device)
        if tuple(mask.shape) != tuple(lead):
            raise BatchError(
                f"{_where(cfg)}: attention_mask of shape {tuple(mask.shape)} does not match its "
                f"predictions {tuple(preds.shape)}"
            )
        valid = mask.bool()
    if cfg.is_causal_lm:  # position t predicts token t+1
        preds, labels, valid = preds[:, :-1], labels[:, 1:], valid[:, 1:]
    return preds, labels, valid


# ---------------------------------------------------------------------- the loss
def head_loss(
    cfg: HeadConfig,
    preds: torch.Tensor,
    labels: Any,
    attention_mask: torch.Tensor | None,
    check: bool = True,
) -> torch.Tensor:
    """Validate ``labels`` for this head and return its scalar loss.

    ``check=False`` skips the checks that read label values on the host (class range,
    finiteness, target range): ``guards.ValueChecks`` runs them once per batch signature on
    accelerators; dtype and shape are always checked.

    preds: (batch, n) for sequence heads, (batch, seq, n) otherwise. The loss is the mean over
    the label elements that count; when nothing counts it is an exact zero that still belongs
    to the graph.
    """
    spec: LossSpec = LOSSES.get(cfg.loss_fct)
    labels = fit_labels(cfg, preds, labels_as_tensor(labels, preds.device, _where(cfg)))
    preds, labels, valid = counted_positions(cfg, preds, labels, attention_mask)
    if spec.classes:
        per, weights = _class_loss(cfg, spec, preds, labels, valid, check)
    else:
        per, weights = _value_loss(cfg, spec, preds, labels, valid, check)
    per = torch.where(weights > 0, per, torch.zeros_like(per))
    return per.sum() / weights.sum().clamp(min=1)


def _class_loss(
    cfg: HeadConfig,
    spec: LossSpec,
    preds: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    n_out = preds.shape[-1]
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise BatchError(
            f"{_where(cfg)}: loss_fct={cfg.loss_fct!r} needs integer class indices, got "
            f"labels of dtype {labels.dtype}"
        )
    labels = labels.long()
    valid = valid & (labels != IGNORE_INDEX)
    bad = valid & ((labels < 0) | (labels >= n_out)) if check else None
    if bad is not None and bool(bad.any()):
        value = int(labels[bad][0])
        raise BatchError(
            f"{_where(cfg)}: class index {value} is out of range for num_outputs={n_out}; "
            f"allowed: 0..{n_out - 1} (or {IGNORE_INDEX} to ignore)"
        )
    target = torch.where(valid, labels, IGNORE_INDEX)
    per = spec.fn(preds.reshape(-1, n_out).float(), target.reshape(-1))
    return per, valid.reshape(-1).to(per.dtype)


def _value_loss(
    cfg: HeadConfig,
    spec: LossSpec,
    preds: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not (labels.dtype.is_floating_point or labels.dtype in _NUMERIC):
        raise BatchError(
            f"{_where(cfg)}: loss_fct={cfg.loss_fct!r} needs numeric labels, got {labels.dtype}"
        )
    labels = labels.to(torch.float32)
    counts = valid.unsqueeze(-1).expand_as(labels)
    ignored = labels == IGNORE_INDEX
    if spec.ignores_minus_100:
        counts = counts & ~ignored
    elif check and bool((counts & ignored).any()):
        raise BatchError(
            f"{_where(cfg)}: a label is {IGNORE_INDEX}, the value that marks an ignored position, "
            f"but loss_fct={cfg.loss_fct!r} would train towards it as a real target; use "
            "loss_fct='masked_mse' to ignore such positions"
        )
    if check and bool((counts & ~torch.isfinite(labels)).any()):
        raise BatchError(
            f"{_where(cfg)}: labels contain NaN or infinite values at positions that count; "
            "regression labels must be finite"
        )
    if check and spec.target_range is not None:
        lo, hi = spec.target_range
        outside = counts & ((labels < lo) | (labels > hi))
        if bool(outside.any()):
            raise BatchError(
                f"{_where(cfg)}: loss_fct={cfg.loss_fct!r} needs targets in [{lo:g}, {hi:g}], "
                f"got {float(labels[outside][0])}"
            )
    safe = torch.where(counts, labels, torch.zeros_like(labels))
    per = spec.fn(preds.float(), safe).reshape(-1)
    return per, counts.reshape(-1).to(per.dtype)


_NUMERIC = {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool}


def labels_as_tensor(labels: Any, device: Any, where: str) -> torch.Tensor:
    """``labels`` (tensor, list, array) as a tensor on ``device``; BatchError naming ``where``."""
    if isinstance(labels, torch.Tensor):
        return labels.to(device)
    try:
        return torch.as_tensor(labels, device=device)
    except (TypeError, ValueError, RuntimeError) as e:
        raise BatchError(
            f"{where}: labels of type {type(labels).__name__} cannot become a tensor ({e})"
        ) from None
