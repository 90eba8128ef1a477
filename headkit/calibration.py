"""Calibration of classification heads on validation data: a temperature per head and, for a
binary head or a two-class classifier, a decision threshold.

Temperature scaling (Guo et al., 2017) divides a head's logits by ``T``, chosen to minimise
the negative log-likelihood of the validation labels; the negative log-likelihood is convex
in ``1/T``, so a golden-section search over ``1/T`` finds the optimum. The threshold is the
cut on the (calibrated) positive probability that maximises ``"f1"`` (of the positive class)
or ``"accuracy"`` on the validation rows (ties: the one closest to 0.5). Both are written into
the head's config (``HeadConfig.temperature`` / ``threshold``), saved with the checkpoint, and
``losses.objective.probabilities`` / ``decisions`` read them: ``headkit predict``, ``headkit
eval`` and the metrics use them; training does not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .config import HeadConfig
from .errors import ConfigError
from .losses.objective import IGNORE_INDEX, counted_positions, fit_labels, probabilities, task_of
from .model.labels import route_labels

#: How a threshold may be chosen.
THRESHOLD_METRICS = ("f1", "accuracy")


@dataclass
class Calibration:
    """What ``calibrate`` fitted for one head: ``temperature``, ``threshold`` (None: not
    chosen), the validation negative log-likelihood before and after, and the rows used."""

    temperature: float
    threshold: float | None
    nll_before: float
    nll_after: float
    rows: int


def calibrate(
    model: Any,
    data: Iterable[Any],
    *,
    threshold: str | None = None,
    heads: Iterable[str] | None = None,
    collator: Any = None,
    batch_size: int = 32,
) -> dict[str, Calibration]:
    """Fit a temperature (and, with ``threshold="f1"`` or ``"accuracy"``, a decision
    threshold for binary and two-class heads) per classification head on validation
    ``data`` with labels — a DataLoader, or examples batched by ``collator`` (default
    ``HeadedCollator(model)``), as ``evaluate_head_wise`` reads them — write them into the
    model's head configs and return what was fitted per head. ``heads``: only these."""
    from .metrics import evaluation_batches

    check_threshold_metric(threshold)
    chosen = _calibratable(model, heads)
    preds: dict[str, list[torch.Tensor]] = {n: [] for n in chosen}
    labels: dict[str, list[torch.Tensor]] = {n: [] for n in chosen}
    targets = {model.head_configs[n].target for n in chosen}
    for batch, out in evaluation_batches(model, data, collator, batch_size, progress=False):
        routed = route_labels(
            model.head_configs, {k: v for k, v in batch.items() if k == "labels" or k in targets}
        )
        for name in chosen:
            cfg = model.head_configs[name]
            y = routed.get(cfg.target)
            if y is None:
                continue
            p, y, valid = _counted(cfg, out.preds_by_head[name], y, batch.get("attention_mask"))
            preds[name].append(p[valid].cpu())
            labels[name].append(y[valid].cpu())
    fitted = {}
    for name in chosen:
        if not preds[name]:
            continue
        got = fit_calibration(
            model.head_configs[name], torch.cat(preds[name]), torch.cat(labels[name]), threshold
        )
        fitted[name] = got
    apply_calibration(model, fitted)
    return fitted


def fit_calibration(
    cfg: HeadConfig, preds: torch.Tensor, labels: torch.Tensor, threshold: str | None = None
) -> Calibration:
    """Temperature (and threshold) of one head from its outputs ``preds`` (rows, C) and
    labels (rows,) class indices, or (rows, n) 0/1 targets for a binary head."""
    check_threshold_metric(threshold)
    binary = task_of(cfg) == "binary"
    z, y = _logits(cfg, preds.double()), labels
    keep = (y != IGNORE_INDEX) if not binary else torch.ones_like(y, dtype=torch.bool)
    if not binary:
        z, y = z[keep], y[keep].long()
    if len(y) == 0:
        raise ConfigError(f"head {cfg.name!r}: no validation labels to calibrate on")
    before = _nll(z, y, binary, 1.0)
    inverse = _golden(lambda b: _nll(z, y, binary, 1.0 / b), 1e-2, 1e2)
    t = 1.0 / inverse
    after = _nll(z, y, binary, t)
    if after > before:  # the search's grid missed: keep the head as it is
        t, after = 1.0, before
    cut = None
    if threshold is not None and (binary or preds.shape[-1] == 2):
        calibrated = cfg.replace(temperature=t, threshold=None)
        prob = probabilities(calibrated, preds)
        positive = prob.reshape(-1) if binary else prob[:, 1]
        truth = (y.reshape(-1) > 0.5) if binary else (y == 1)
        counted = (y.reshape(-1) != IGNORE_INDEX) if binary else torch.ones_like(truth)
        cut = choose_threshold(positive[counted], truth[counted], threshold)
    return Calibration(t, cut, before, after, int(len(y)))


def choose_threshold(positive: torch.Tensor, truth: torch.Tensor, metric: str = "f1") -> float:
    """The cut on the positive probability (predict positive at or above it) that maximises
    ``metric`` ("f1" of the positive class, or "accuracy") over the rows; candidates are the
    midpoints between distinct probabilities; ties go to the cut closest to 0.5."""
    check_threshold_metric(metric)
    p = positive.double()
    t = truth.bool()
    values = torch.unique(p)
    cuts = torch.cat([values[:1] / 2, (values[1:] + values[:-1]) / 2, (values[-1:] + 1) / 2])
    cuts = cuts.clamp(1e-6, 1 - 1e-6)
    hat = p[None, :] >= cuts[:, None]  # (cuts, rows)
    tp = (hat & t).sum(1).double()
    fp = (hat & ~t).sum(1).double()
    fn = (~hat & t).sum(1).double()
    if metric == "f1":
        score = 2 * tp / (2 * tp + fp + fn).clamp(min=1)
    else:
        score = (hat == t).double().mean(1)
    best = score.max()
    near = torch.nonzero(score >= best - 1e-12)[:, 0]
    return float(cuts[near[(cuts[near] - 0.5).abs().argmin()]])


def apply_calibration(model: Any, fitted: dict[str, Calibration]) -> None:
    """Write fitted temperatures and thresholds into the model's head configs (saved with
    the checkpoint)."""
    for name, got in fitted.items():
        cfg = model.head_configs[name].replace(temperature=got.temperature, threshold=got.threshold)
        model.head_configs[name] = cfg
        model.heads[name].config = cfg


def check_threshold_metric(threshold: Any) -> None:
    if threshold is not None and threshold not in THRESHOLD_METRICS:
        raise ConfigError(
            f"threshold={threshold!r} is invalid; allowed: {', '.join(THRESHOLD_METRICS)} or "
            "None (keep the default decision)"
        )


# ---------------------------------------------------------------------- helpers
def _calibratable(model: Any, heads: Iterable[str] | None) -> list[str]:
    names = list(model.head_configs) if heads is None else list(heads)
    for name in names:
        if name not in model.head_configs:
            raise ConfigError(
                f"heads: {name!r} is not a head of the model; heads: {sorted(model.head_configs)}"
            )
    ok = [n for n in names if task_of(model.head_configs[n]) in ("classification", "binary")]
    if heads is not None and len(ok) != len(names):
        bad = [n for n in names if n not in ok]
        raise ConfigError(
            f"heads: {bad} cannot be calibrated; temperature scaling applies to classification "
            "and binary heads"
        )
    return ok


def _counted(cfg: HeadConfig, preds: torch.Tensor, labels: Any, mask: Any):
    labels = fit_labels(cfg, preds, torch.as_tensor(labels, device=preds.device))
    p, y, valid = counted_positions(cfg, preds, labels, mask)
    if task_of(cfg) == "binary":
        return p, y, valid
    return p, y, valid & (y != IGNORE_INDEX)


def _logits(cfg: HeadConfig, preds: torch.Tensor) -> torch.Tensor:
    """The head's raw outputs as logits (a binary head with probability outputs: their
    logit)."""
    spec = cfg.spec
    if task_of(cfg) == "binary" and spec is not None and spec.needs_probabilities:
        return torch.logit(preds.clamp(1e-7, 1 - 1e-7))
    return preds


def _nll(z: torch.Tensor, y: torch.Tensor, binary: bool, t: float) -> float:
    if binary:
        keep = y != IGNORE_INDEX
        return float(F.binary_cross_entropy_with_logits(z[keep] / t, y[keep].double()))
    return float(F.cross_entropy(z / t, y))


def _golden(f: Any, lo: float, hi: float, steps: int = 60) -> float:
    """The minimum of a unimodal ``f`` on [lo, hi] by golden-section search on a log scale."""
    a, b = math.log(lo), math.log(hi)
    r = (math.sqrt(5) - 1) / 2
    c, d = b - r * (b - a), a + r * (b - a)
    fc, fd = f(math.exp(c)), f(math.exp(d))
    for _ in range(steps):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - r * (b - a)
            fc = f(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + r * (b - a)
            fd = f(math.exp(d))
    return math.exp((a + b) / 2)
