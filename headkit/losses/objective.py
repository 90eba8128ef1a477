"""A head's objective in one place: the loss registry, what each loss needs, which positions count.

A loss is a ``LossSpec``: an element-wise function (``reduction="none"`` semantics) plus every
property anything else asks about — how it reads labels (class indices or values), what -100
means to it, the target range, whether it needs probabilities, which metrics fit it and the
decision threshold. Validation (``HeadConfig``), the loss (``head_loss``), the metrics, the
collator and feature caching all ask the spec, so a loss registered by a user behaves like a
built-in one. Names are looked up case-insensitively (``LOSSES.get``), once.

How a head reads its labels is one rule (``label_rule``, from the spec and the head's task
and layout): one label per example or per position, class indices or values, whether -100
is skipped, their dtype. The collator, feature caching, ``head_loss`` and the metrics all ask
it, and ``target_rules`` refuses, when the model is built, a target that one head would read
per example and another per position.

Which positions count is one rule (``counted_positions``): padding does not count for token
heads with ``ignore_pads``, and a causal-LM head's prediction at t is scored against the label
at t + 1. The label value -100 marks a position to ignore: losses that can ignore it
(``ignores_minus_100``: class indices, binary targets, ``masked_mse``) skip it; losses for
which it would be a real value (``mse``, ``l1``, ``smooth_l1``) refuse it with a BatchError
rather than train towards -100 (use ``masked_mse``). Metrics skip it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..errors import BatchError, ConfigError
from ..registry import Registry
from .pairwise import bradley_terry, centering, pair_scores

if TYPE_CHECKING:
    from ..config import HeadConfig

IGNORE_INDEX = -100


@dataclass(frozen=True)
class LossSpec:
    """``fn(preds, labels) -> per-element loss`` and what it needs.

    ``classes=True``: preds (N, C) logits, labels (N,) integer class indices.
    ``classes=False``: preds (N, n), labels (N, n) floats (a (N,) label is read as (N, 1)).
    ``ignores_minus_100``: label values equal to -100 contribute nothing (otherwise -100 at
    a position that counts is refused; class indices always skip it, no class being
    negative: the ``fn`` of a class loss gets -100 where nothing counts).
    ``target_range``: allowed label values, inclusive. ``needs_probabilities``: predictions
    must be in [0, 1] (the head's output activation must give them). ``metric``: which
    metrics fit: "classification" (class indices, the default with ``classes``), else
    "regression" (the default) or "binary". ``threshold``: the decision threshold of binary
    predictions. ``zeroes_ignored`` (class losses): ``fn`` itself returns an exact 0 where the
    label is -100 (as ``F.cross_entropy(..., ignore_index=-100)`` does), so the loss needs no
    mask of its own (otherwise the skipped elements are set to 0 after ``fn``).
    ``options``: the options ``fn`` takes as keywords and their defaults (a head sets them in
    ``HeadConfig.loss_options``, e.g. focal's ``gamma``). ``pos_weight``: ``fn`` takes
    ``pos_weight=`` (a tensor of one weight per output), which ``HeadConfig.pos_weight`` sets.
    ``stackable``: ``fn`` computes each row from that row alone, the same way wherever the row
    lies in memory (no element-wise ``exp``/``log``, whose vector lanes and scalar tail may
    round differently), so heads sharing labels may run it as one call on their stacked
    predictions with the same bits (``losses.shared``).
    Class losses weigh each label by ``HeadConfig.class_weights`` (the weighted mean, as
    ``cross_entropy(weight=)``).
    """

    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    classes: bool = False
    ignores_minus_100: bool = False
    target_range: tuple[float, float] | None = None
    needs_probabilities: bool = False
    metric: str | None = None
    threshold: float | None = None
    zeroes_ignored: bool = False
    pairwise: bool = False
    options: Mapping[str, float] = field(default_factory=dict)
    pos_weight: bool = False
    stackable: bool = False

    def __post_init__(self) -> None:
        if self.zeroes_ignored and not self.classes:
            raise ConfigError(
                "LossSpec: zeroes_ignored=True is only read for class losses (classes=True); "
                "a value loss's skipped elements are always masked"
            )
        if self.metric is None:
            default = "pairwise" if self.pairwise else "regression"
            object.__setattr__(self, "metric", "classification" if self.classes else default)
        if self.metric not in ("classification", "binary", "regression", "pairwise"):
            raise ConfigError(
                f"LossSpec: metric={self.metric!r} is invalid; 'classification', 'binary', "
                "'regression' or 'pairwise'"
            )
        if (self.metric == "pairwise") != self.pairwise or (self.pairwise and self.classes):
            raise ConfigError(
                f"LossSpec: metric={self.metric!r} does not fit pairwise={self.pairwise}, "
                f"classes={self.classes}; a pairwise loss has metric 'pairwise' and classes=False"
            )
        if (self.metric == "classification") != self.classes:
            allowed = "'classification'" if self.classes else "'binary' or 'regression'"
            raise ConfigError(
                f"LossSpec: metric={self.metric!r} does not fit classes={self.classes} (labels "
                f"{'are' if self.classes else 'are not'} class indices); allowed: {allowed}"
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
        zeroes_ignored=True,
        stackable=True,  # log_softmax runs each row on its own; then a gather
    ),
)
LOSSES.register("mse", LossSpec(lambda p, y: F.mse_loss(p, y, reduction="none"), stackable=True))
LOSSES.register(
    "masked_mse",
    LossSpec(
        lambda p, y: F.mse_loss(p, y, reduction="none"), ignores_minus_100=True, stackable=True
    ),
)
LOSSES.register("l1", LossSpec(lambda p, y: F.l1_loss(p, y, reduction="none"), stackable=True))
LOSSES.register(
    "smooth_l1", LossSpec(lambda p, y: F.smooth_l1_loss(p, y, reduction="none"), stackable=True)
)
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
        lambda p, y, pos_weight=None: F.binary_cross_entropy_with_logits(
            p, y, reduction="none", pos_weight=pos_weight
        ),
        ignores_minus_100=True,
        target_range=(0.0, 1.0),
        metric="binary",
        pos_weight=True,
    ),
)


def focal_loss(preds: torch.Tensor, labels: torch.Tensor, gamma: float = 2.0) -> torch.Tensor:
    """Focal loss (Lin et al., 2017), per row: ``-(1 - p_y)^gamma * log p_y`` with ``p_y`` the
    softmax probability of the label (``gamma=0`` is cross-entropy); 0 where the label is
    -100. preds (N, C) logits, labels (N,) class indices."""
    counted = labels != IGNORE_INDEX
    log_p = F.log_softmax(preds, -1).gather(-1, torch.where(counted, labels, 0)[:, None])[:, 0]
    loss = -((1 - log_p.exp()).clamp(min=0) ** gamma) * log_p
    return torch.where(counted, loss, torch.zeros_like(loss))


LOSSES.register(
    "focal",
    LossSpec(
        focal_loss,
        classes=True,
        ignores_minus_100=True,
        zeroes_ignored=True,
        options={"gamma": 2.0},
    ),
)


LOSSES.register(
    "bradley_terry",
    LossSpec(bradley_terry, ignores_minus_100=True, pairwise=True),
)


def loss_spec(cfg: HeadConfig) -> LossSpec | None:
    """The head's LossSpec, or None for a head without a loss."""
    return None if cfg.loss_fct is None else LOSSES.get(cfg.loss_fct)


def task_of(cfg: HeadConfig) -> str:
    """ "lm", "regression", "binary", "classification" or "pairwise": which metrics the
    head gets."""
    if cfg.is_causal_lm:
        return "lm"
    spec = loss_spec(cfg)
    if spec is not None and spec.pairwise:
        return "pairwise"
    if cfg.is_regression:
        return "regression"
    return spec.metric if spec is not None else "classification"  # type: ignore[return-value]


def probabilities(cfg: HeadConfig, preds: torch.Tensor) -> torch.Tensor:
    """The head's outputs as probabilities, calibrated by ``cfg.temperature``: a softmax over
    classes (classification), the positive probability per output (binary: the sigmoid of
    logits, or probabilities rescaled in logit space)."""
    t = float(cfg.temperature)
    p = preds.float()
    if task_of(cfg) != "binary":
        return torch.softmax(p / t, -1)
    spec = loss_spec(cfg)
    if spec is not None and spec.needs_probabilities:
        if t == 1.0:
            return p
        p = torch.logit(p.clamp(1e-7, 1 - 1e-7))
    return torch.sigmoid(p / t)


def decisions(cfg: HeadConfig, preds: torch.Tensor) -> torch.Tensor:
    """The head's decisions: the class index (argmax, or with ``cfg.threshold`` on a two-class
    head, class 1 when its probability is at least the threshold) or the 0/1 decision per
    output of a binary head (its probability at least ``cfg.threshold``, else the loss's own
    threshold on the raw outputs)."""
    if task_of(cfg) == "binary":
        if cfg.threshold is None:
            return (preds > loss_spec(cfg).threshold).long()
        return (probabilities(cfg, preds) >= cfg.threshold).long()
    if cfg.threshold is not None and preds.shape[-1] == 2:
        return (probabilities(cfg, preds)[..., 1] >= cfg.threshold).long()
    return preds.argmax(-1)


def _where(cfg: HeadConfig) -> str:
    return f"head {cfg.name!r} (target {cfg.target!r})"


# ---------------------------------------------------------------------- the label rule
@dataclass(frozen=True)
class LabelRule:
    """How one head reads its labels; every label reader asks ``label_rule``.

    ``layout``: "sequence" (one label, or row of ``num_outputs`` values, per example) or
    "token" (one per position). ``shift``: a causal-LM head's prediction at t meets the label
    at t + 1. ``classes``: integer class indices, else ``num_outputs`` values per label.
    ``ignore_index``: -100 when a label of that value is skipped, None when -100 would be a
    real value (the loss refuses it). ``dtype``: what labels become before the loss
    (``torch.long`` for class indices, ``torch.float32`` for values). ``task``: the metric
    family ("classification", "binary", "regression", "lm"). ``skips_padding``: positions
    the attention mask marks as padding do not count (token layouts with ``ignore_pads``).
    """

    layout: str
    shift: bool
    classes: bool
    ignore_index: int | None
    dtype: torch.dtype
    task: str
    skips_padding: bool


def label_rule(cfg: HeadConfig) -> LabelRule:
    """The head's ``LabelRule``, from its ``LossSpec`` (``cfg.spec``) and ``task``/``layout``.

    A head without a loss reads class indices unless it is a regression head. -100 is skipped
    by class indices (no class is negative), by losses whose spec ``ignores_minus_100`` and by
    heads without a loss (their labels only serve metrics).
    """
    spec = loss_spec(cfg)
    task = task_of(cfg)
    classes = spec.classes if spec is not None else task in ("classification", "lm")
    skips = spec is None or spec.ignores_minus_100 or classes
    sequence = cfg.layout == "sequence"
    return LabelRule(
        layout="sequence" if sequence else "token",
        shift=cfg.layout == "causal_lm",
        classes=classes,
        ignore_index=IGNORE_INDEX if skips else None,
        dtype=torch.long if classes else torch.float32,
        task=task,
        skips_padding=not sequence and bool(cfg.ignore_pads),
    )


@dataclass(frozen=True)
class TargetRule:
    """How the labels of one target are read: their ``layout`` (the same for every head that
    reads them) and each reading head's ``LabelRule`` by head name."""

    layout: str
    heads: dict[str, LabelRule]

    @property
    def ignores_minus_100(self) -> bool:
        """Whether every head reading the target skips -100 (so -100 may fill a gap)."""
        return all(r.ignore_index is not None for r in self.heads.values())


def target_rules(
    head_configs: Mapping[str, HeadConfig] | Iterable[HeadConfig],
) -> dict[str, TargetRule]:
    """Each target's ``TargetRule``; a ConfigError naming both heads when one target would be
    read as one label per example by one head and one label per position by another."""
    configs = head_configs.values() if isinstance(head_configs, Mapping) else head_configs
    first: dict[str, HeadConfig] = {}
    rules: dict[str, dict[str, LabelRule]] = {}
    for cfg in configs:
        rule = label_rule(cfg)
        seen = first.setdefault(cfg.target, cfg)
        if seen is not cfg and label_rule(seen).layout != rule.layout:
            a, b = (seen, cfg) if seen.pred_for_sequence else (cfg, seen)
            raise ConfigError(
                f"target {cfg.target!r} is read by sequence head {a.name!r} (one label per "
                f"example) and by token head {b.name!r} (one label per position); one target "
                "has one layout: give one of the heads another target (HeadConfig(..., "
                "target=...))"
            )
        rules.setdefault(cfg.target, {})[cfg.name] = rule
    return {t: TargetRule(label_rule(first[t]).layout, r) for t, r in rules.items()}


# ---------------------------------------------------------------------- positions
def fit_labels(cfg: HeadConfig, preds: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Check ``labels`` against the head's predictions and bring them to their layout.

    Class indices: preds' leading shape, (batch,) or (batch, seq). Values: preds' shape
    (a label without the last dimension is accepted when num_outputs is 1).
    """
    batch = preds.shape[0]
    n_out = preds.shape[-1]
    if labels.dim() == 0 and batch == 1 and cfg.pred_for_sequence:
        labels = labels.reshape(1)  # ``torch.tensor(1)`` for one example
    if labels.dim() == 0 or labels.shape[0] != batch:
        raise BatchError(
            f"{_where(cfg)}: labels of shape {tuple(labels.shape)} do not match the batch size "
            f"{batch}"
        )
    lead = tuple(preds.shape[:-1])  # (batch,) or (batch, seq)
    rule = label_rule(cfg)
    classes, sequence = rule.classes, rule.layout == "sequence"
    expected = [lead] if classes else [lead + (n_out,)] + ([lead] if n_out == 1 else [])
    if rule.task == "pairwise":  # a role per row, or (role, margin): losses/pairwise.py
        expected = [lead, lead + (1,), lead + (2,)]
    if tuple(labels.shape) not in expected:
        hint = ""
        if sequence and labels.dim() >= 2 and labels.shape[1] != n_out:
            hint = " (token-level labels given to a sequence head?)"
        elif not sequence and labels.dim() == 1:
            hint = " (one label per sequence given to a token head? set pred_for_sequence=True)"
        elif not sequence and labels.dim() >= 2 and labels.shape[1] != lead[1]:
            hint = f" (label sequence length {labels.shape[1]} != input length {lead[1]})"
        raise BatchError(
            f"{_where(cfg)} is a {rule.layout} head: labels of shape {tuple(labels.shape)} do not "
            f"fit; expected {' or '.join(str(e) for e in expected)}{hint}"
        )
    if not classes and labels.dim() == len(lead):
        labels = labels.unsqueeze(-1)
    return labels


def counted_positions(
    cfg: HeadConfig, preds: torch.Tensor, labels: torch.Tensor, attention_mask: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one rule for which positions count: returns ``(preds, labels, valid)``.

    ``valid`` has preds' leading shape after alignment. Padding (mask 0) does not count when
    the label rule ``skips_padding`` (token heads with ``ignore_pads``); with ``shift`` (a
    causal-LM head) the prediction at t meets the label at t + 1 (preds lose the last
    position, labels and ``valid`` the first). -100 is not handled here: see ``head_loss``
    and the metrics.
    """
    rule = label_rule(cfg)
    lead = preds.shape[:-1]
    valid = torch.ones(lead, dtype=torch.bool, device=preds.device)
    if rule.skips_padding and attention_mask is not None:
        mask = torch.as_tensor(attention_mask, device=preds.device)
        if tuple(mask.shape) != tuple(lead):
            raise BatchError(
                f"{_where(cfg)}: attention_mask of shape {tuple(mask.shape)} does not match its "
                f"predictions {tuple(preds.shape)}"
            )
        valid = mask.bool()
    if rule.skips_padding and cfg.ignore_pads == "drop_last_real" and not rule.shift:
        valid = valid & ~_last_real(valid)  # config.DROP_LAST_REAL
    if rule.shift:  # position t predicts token t+1
        preds, labels, valid = preds[:, :-1], labels[:, 1:], valid[:, 1:]
    return preds, labels, valid


def _last_real(valid: torch.Tensor) -> torch.Tensor:
    """(batch, seq) bool → True at each row's last True position."""
    seq = valid.shape[-1]
    idx = torch.arange(seq, device=valid.device).expand_as(valid)
    last = torch.where(valid, idx, -1).max(-1, keepdim=True).values
    return idx == last


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
    to the graph. (``count_labels`` then ``counted_loss``; ``losses.shared.head_losses``
    shares the first among heads.) A pairwise loss reads rows as pairs instead (``_pair_loss``).
    """
    spec: LossSpec = LOSSES.get(cfg.loss_fct)
    if spec.pairwise:
        labels = fit_labels(cfg, preds, labels_as_tensor(labels, preds.device, _where(cfg)))
        return _pair_loss(cfg, spec, preds, labels)
    return counted_loss(cfg, preds, count_labels(cfg, preds, labels, attention_mask, check))


@dataclass
class CountedLabels:
    """A target's labels, made ready for the loss of every head that reads them alike.

    ``target``: what the loss function gets, aligned with the predictions (after the causal
    shift): class indices (N,) with -100 where nothing counts, or values of the predictions'
    shape with 0 where nothing counts. ``counts``: (N,) booleans, the label elements that count
    (None: every one does). ``total``: how many count, at least 1 (float32, the mean's
    denominator). ``shift``: the predictions lose their last position first.
    """

    target: torch.Tensor
    counts: torch.Tensor | None
    total: torch.Tensor
    shift: bool
    _skipped: torch.Tensor | None = field(default=None, repr=False)

    def skipped(self) -> torch.Tensor | None:
        """(N,) True where nothing counts (None: every element counts); computed once, when a
        head first needs it (not ``functools.cached_property``: its lock stops torch.compile)."""
        if self._skipped is None and self.counts is not None:
            self._skipped = ~self.counts
        return self._skipped


def count_labels(
    cfg: HeadConfig,
    preds: torch.Tensor,
    labels: Any,
    attention_mask: torch.Tensor | None,
    check: bool = True,
) -> CountedLabels:
    """Check ``labels`` for the head ``cfg`` (predictions of ``preds``' shape: only its shape
    and device are read) and count which elements count (``counted_positions``, -100)."""
    labels = fit_labels(cfg, preds, labels_as_tensor(labels, preds.device, _where(cfg)))
    _, labels, valid = counted_positions(cfg, preds, labels, attention_mask)
    rule = label_rule(cfg)
    if rule.classes:
        return _count_classes(cfg, rule, preds.shape[-1], labels, valid, check)
    every = rule.ignore_index is None and not (rule.skips_padding and attention_mask is not None)
    return _count_values(cfg, rule, labels, valid, every, check)


def counted_loss(cfg: HeadConfig, preds: torch.Tensor, counted: CountedLabels) -> torch.Tensor:
    """The head's mean loss over what counts: its own work only (the loss function, a mask
    where it does not zero what is skipped itself, a sum and a division)."""
    spec: LossSpec = LOSSES.get(cfg.loss_fct)
    if counted.shift:  # position t predicts token t+1
        preds = preds[:, :-1]
    options = loss_options(cfg)
    if spec.classes:
        per = spec.fn(preds.reshape(-1, preds.shape[-1]).float(), counted.target, **options)
        zeroed = spec.zeroes_ignored
    else:
        if cfg.pos_weight is not None:
            options["pos_weight"] = torch.tensor(
                cfg.pos_weight, dtype=torch.float32, device=preds.device
            ).reshape(-1)
        per = spec.fn(preds.float(), counted.target, **options).reshape(-1)
        zeroed = False
    if counted.counts is not None and not zeroed:
        per = per.masked_fill(counted.skipped(), 0)
    if spec.classes and cfg.class_weights is not None:
        return _weighted_mean(cfg, per, counted)
    return per.sum() / counted.total


def _weighted_mean(cfg: HeadConfig, per: torch.Tensor, counted: CountedLabels) -> torch.Tensor:
    """``sum(w_y * loss) / sum(w_y)`` over the labels that count, as
    ``F.cross_entropy(weight=)`` computes it."""
    if not isinstance(cfg.class_weights, list):
        raise ConfigError(
            f"{_where(cfg)}: class_weights={cfg.class_weights!r} is not resolved yet; compute "
            "the weights from the training labels first (HeadConfig.with_class_weights(labels), "
            "or headkit train does it)"
        )
    table = torch.tensor(cfg.class_weights, dtype=per.dtype, device=per.device)
    weights = table[counted.target.clamp(min=0)]
    if counted.counts is not None:
        weights = weights.masked_fill(counted.skipped(), 0)
    total = weights.sum()
    return (per * weights).sum() / torch.where(total > 0, total, torch.ones_like(total))


def _pair_loss(
    cfg: HeadConfig, spec: LossSpec, preds: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Mean of ``spec.fn`` over the batch's pairs (``losses/pairwise.py``), plus TRL's
    centering term when ``center_rewards_coefficient`` is set; no pair: an exact zero."""
    if not (labels.dtype.is_floating_point or labels.dtype in _NUMERIC):
        raise BatchError(
            f"{_where(cfg)}: loss_fct={cfg.loss_fct!r} needs numeric labels (1 chosen, 0 "
            f"rejected, -100 not read), got {labels.dtype}"
        )
    chosen, rejected, margin = pair_scores(preds.float(), labels.float(), _where(cfg))
    if chosen.numel() == 0:
        return preds.sum() * 0.0
    loss = spec.fn(chosen, rejected, margin).mean()
    coefficient = getattr(cfg, "center_rewards_coefficient", None)
    if coefficient is not None:
        loss = loss + coefficient * centering(chosen, rejected)
    return loss


def _count_classes(
    cfg: HeadConfig,
    rule: LabelRule,
    n_out: int,
    labels: torch.Tensor,
    valid: torch.Tensor,
    check: bool = True,
) -> CountedLabels:
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise BatchError(
            f"{_where(cfg)}: loss_fct={cfg.loss_fct!r} needs integer class indices, got "
            f"labels of dtype {labels.dtype}"
        )
    labels = labels.to(rule.dtype)
    if rule.ignore_index is not None:
        valid = valid & (labels != rule.ignore_index)
    bad = valid & ((labels < 0) | (labels >= n_out)) if check else None
    if bad is not None and bool(bad.any()):
        value = int(labels[bad][0])
        raise BatchError(
            f"{_where(cfg)}: class index {value} is out of range for num_outputs={n_out}; "
            f"allowed: 0..{n_out - 1} (or {IGNORE_INDEX} to ignore)"
        )
    target = torch.where(valid, labels, IGNORE_INDEX).reshape(-1)
    counts = valid.reshape(-1)
    return CountedLabels(target, counts, _total(counts), rule.shift)


def _count_values(
    cfg: HeadConfig,
    rule: LabelRule,
    labels: torch.Tensor,
    valid: torch.Tensor,
    every: bool,
    check: bool = True,
) -> CountedLabels:
    """``every``: every position is valid and -100 is not skipped (so every element counts)."""
    if not (labels.dtype.is_floating_point or labels.dtype in _NUMERIC):
        raise BatchError(
            f"{_where(cfg)}: loss_fct={cfg.loss_fct!r} needs numeric labels, got {labels.dtype}"
        )
    spec: LossSpec = LOSSES.get(cfg.loss_fct)
    labels = labels.to(rule.dtype)
    counts = valid.unsqueeze(-1).expand_as(labels)
    ignored = labels == IGNORE_INDEX
    if rule.ignore_index is not None:
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
    flat = counts.reshape(-1)
    if every:
        return CountedLabels(labels, None, _total(flat), rule.shift)
    safe = torch.where(counts, labels, torch.zeros_like(labels))
    return CountedLabels(safe, flat, _total(flat), rule.shift)


def _total(counts: torch.Tensor) -> torch.Tensor:
    """How many elements count, at least 1 (the denominator of a head's mean loss)."""
    return counts.to(torch.float32).sum().clamp(min=1)


def loss_options(cfg: HeadConfig) -> dict[str, Any]:
    """The keyword options of the head's loss function: its spec's defaults, updated by
    ``cfg.loss_options``."""
    spec = loss_spec(cfg)
    if spec is None:
        return {}
    return {**spec.options, **cfg.loss_options}


def balanced_class_weights(labels: Any, num_classes: int) -> list[float]:
    """scikit-learn's ``"balanced"`` weights: ``n / (num_classes * count_c)`` per class, from
    the training labels (class indices; -100 skipped); a class absent from them is counted
    once (``n / num_classes``)."""
    y = torch.as_tensor(labels).reshape(-1).long()
    y = y[y != IGNORE_INDEX]
    if len(y) == 0:
        raise ConfigError("class_weights='balanced' needs training labels; none were given")
    counts = torch.bincount(y, minlength=num_classes).double()
    weights = len(y) / (num_classes * counts.clamp(min=1))
    return [float(w) for w in weights]


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
