"""Per-head evaluation metrics.

Which metrics a head gets follows its config: causal-LM heads → ``perplexity`` (exp of the
shifted cross-entropy, as the head's loss computes it); regression heads → ``mse``, ``mae``,
``r2`` (averaged over outputs, as sklearn's ``multioutput="uniform_average"``); binary heads
(``bce``/``bce_with_logits``) → element-wise ``accuracy`` and ``macro_f1`` (the positive-class
F1 averaged over outputs); other heads → ``accuracy`` and ``macro_f1`` over the classes that
occur in labels or predictions (sklearn's ``average="macro"``); pairwise (reward) heads
(``bradley_terry``) → ``pairwise_accuracy`` (the share of pairs whose chosen text scores
strictly higher, as TRL's ``accuracy``) and ``mean_margin`` (the mean of r_chosen -
r_rejected, TRL's ``margin``), over the pairs of each batch (``losses/pairwise.py``).

Label value -100 never counts (it marks ignored and padded positions; the collator and
Trainer pad with it), and with an attention mask neither do padded tokens of heads with
``ignore_pads``. Statistics accumulate batch by batch, so nothing is kept per example.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from .config import HeadConfig
from .errors import BatchError
from .losses.objective import (
    IGNORE_INDEX,
    counted_positions,
    decisions,
    fit_labels,
    label_rule,
)
from .losses.pairwise import pair_scores
from .model.labels import keep_model_columns, loss_heads, route_labels, without_unused_labels


class HeadMetric:
    """Streaming metrics of one head: ``update(preds, labels, mask)`` per batch, then
    ``compute()`` → {metric: value}. preds: (batch, n) or (batch, seq, n)."""

    def __init__(self, cfg: HeadConfig) -> None:
        self.cfg = cfg
        self.rule = label_rule(cfg)  # how the head reads its labels, as its loss does
        self.kind = self.rule.task
        n = int(cfg.num_outputs or 1)
        self.n = n
        if self.kind == "classification":
            self.confusion = np.zeros((n, n), dtype=np.int64)  # [label, prediction]
        elif self.kind == "binary":
            self.counts = np.zeros((n, 4), dtype=np.int64)  # tp, fp, fn, tn per output
        elif self.kind == "regression":
            # per output: count, mean of y, sum of squared deviations of y (merged batch by
            # batch with Chan's parallel update: stable for labels with a large offset),
            # sum of squared errors, sum of absolute errors
            self.sums = np.zeros((n, 5), dtype=np.float64)
        elif self.kind == "pairwise":
            self.pairs, self.correct, self.margin_sum = 0, 0, 0.0
        else:
            self.nll = 0.0
            self.tokens = 0

    # ------------------------------------------------------------------ update
    def update(self, preds: Any, labels: Any, attention_mask: Any | None = None) -> HeadMetric:
        """Add one batch. ``attention_mask`` (batch, seq) masks padded tokens."""
        p = _tensor(preds)
        y = fit_labels(self.cfg, p, _tensor(labels))
        if self.kind == "pairwise":
            chosen, rejected, _ = pair_scores(p.double(), y.double(), f"head {self.cfg.name!r}")
            self.pairs += int(chosen.numel())
            self.correct += int((chosen > rejected).sum())
            self.margin_sum += float((chosen - rejected).sum())
            return self
        mask = None if attention_mask is None else _tensor(attention_mask)
        p, y, valid = counted_positions(self.cfg, p, y, mask)
        if self.rule.classes:
            y = y.long()
            valid = valid & (y != IGNORE_INDEX)
            if self.kind == "lm":
                self._update_lm(p, y, valid)
            else:
                self._update_classes(p, y, valid)
            return self
        y = y.double()
        elem = valid.unsqueeze(-1).expand_as(y) & (y != IGNORE_INDEX) & torch.isfinite(y)
        p = p.double().reshape(-1, self.n)
        y = y.reshape(-1, self.n)
        elem = elem.reshape(-1, self.n)
        if self.kind == "binary":
            hat = decisions(self.cfg, p).bool()  # the head's threshold, as predict decides
            pos = y > 0.5
            for j, cell in enumerate((hat & pos, hat & ~pos, ~hat & pos, ~hat & ~pos)):
                self.counts[:, j] += (cell & elem).sum(0).numpy()  # tp, fp, fn, tn
        else:
            self._update_regression(p, y, elem)
        return self

    def _update_regression(self, p: torch.Tensor, y: torch.Tensor, elem: torch.Tensor) -> None:
        zero = torch.zeros_like(y)
        n_b = elem.sum(0).double()  # (n,)
        mean_b = torch.where(elem, y, zero).sum(0) / n_b.clamp(min=1)
        dev = torch.where(elem, y - mean_b, zero)
        m2_b = (dev * dev).sum(0)
        e = torch.where(elem, p - y, zero)
        n_a, mean_a, m2_a = (torch.from_numpy(self.sums[:, j].copy()) for j in range(3))
        n = n_a + n_b
        delta = mean_b - mean_a
        safe_n = n.clamp(min=1)
        self.sums[:, 0] = n.numpy()
        self.sums[:, 1] = (mean_a + delta * n_b / safe_n).numpy()
        self.sums[:, 2] = (m2_a + m2_b + delta * delta * n_a * n_b / safe_n).numpy()
        self.sums[:, 3] += (e * e).sum(0).numpy()
        self.sums[:, 4] += e.abs().sum(0).numpy()

    def _update_classes(self, p: torch.Tensor, y: torch.Tensor, valid: torch.Tensor) -> None:
        y = y[valid]
        hat = decisions(self.cfg, p[valid])  # argmax, or a two-class head's threshold
        bad = (y < 0) | (y >= self.n)
        if bool(bad.any()):
            raise BatchError(
                f"head {self.cfg.name!r}: label {int(y[bad][0])} is out of range for "
                f"num_outputs={self.n}; allowed: 0..{self.n - 1} (or {IGNORE_INDEX} to ignore)"
            )
        idx = (y * self.n + hat).numpy()
        self.confusion += np.bincount(idx, minlength=self.n * self.n).reshape(self.n, self.n)

    def _update_lm(self, p: torch.Tensor, y: torch.Tensor, valid: torch.Tensor) -> None:
        target = torch.where(valid, y, IGNORE_INDEX)
        logits = p.reshape(-1, p.shape[-1]).double()
        nll = F.cross_entropy(
            logits, target.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        self.nll += float(nll)
        self.tokens += int(valid.sum())

    # ------------------------------------------------------------------ results
    def compute(self) -> dict[str, float]:
        """The metrics so far; empty when no position counted."""
        if self.kind == "classification":
            if self.confusion.sum() == 0:
                return {}
            report = confusion_report(self.confusion)
            return {"accuracy": report["accuracy"], "macro_f1": report["macro_f1"]}
        if self.kind == "binary":
            tp, fp, fn, tn = (self.counts[:, j].astype(np.float64) for j in range(4))
            total = (tp + fp + fn + tn).sum()
            if total == 0:
                return {}
            denom = 2 * tp + fp + fn
            f1 = np.where(denom > 0, 2 * tp / np.maximum(denom, 1), 0.0)
            return {"accuracy": float((tp + tn).sum() / total), "macro_f1": float(f1.mean())}
        if self.kind == "pairwise":
            if self.pairs == 0:
                return {}
            return {
                "pairwise_accuracy": self.correct / self.pairs,
                "mean_margin": self.margin_sum / self.pairs,
            }
        if self.kind == "regression":
            n, _, ss_tot, see, sae = (self.sums[:, j] for j in range(5))
            cols = n > 0
            if not cols.any():
                return {}
            n, ss_tot, see, sae = n[cols], ss_tot[cols], see[cols], sae[cols]
            r2 = np.where(
                ss_tot > 0, 1 - see / np.where(ss_tot > 0, ss_tot, 1), np.where(see == 0, 1.0, 0.0)
            )
            return {
                "mse": float((see / n).mean()),
                "mae": float((sae / n).mean()),
                "r2": float(r2.mean()),
            }
        if self.tokens == 0:
            return {}
        return {"perplexity": math.exp(self.nll / self.tokens)}


def confusion_report(confusion: np.ndarray, classes: list | None = None) -> dict[str, Any]:
    """Per-class and averaged metrics of a confusion matrix ``[label, prediction]``, as
    scikit-learn computes them: ``accuracy``, ``micro_f1`` (= accuracy for one label per
    row), ``macro_precision``/``macro_recall``/``macro_f1`` (unweighted mean over the classes
    that occur in labels or predictions; a class never predicted has precision 0),
    ``weighted_f1`` (weighted by support), ``per_class`` {class: precision, recall, f1,
    support} and ``confusion_matrix`` (rows: labels, columns: predictions)."""
    c = np.asarray(confusion, dtype=np.float64)
    total = c.sum()
    tp = np.diag(c)
    predicted, support = c.sum(0), c.sum(1)
    precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
    recall = np.divide(tp, support, out=np.zeros_like(tp), where=support > 0)
    denom = precision + recall
    f1 = np.divide(2 * precision * recall, denom, out=np.zeros_like(tp), where=denom > 0)
    seen = (predicted + support) > 0
    names = classes if classes is not None else list(range(len(c)))
    return {
        "accuracy": float(tp.sum() / max(total, 1)),
        "micro_f1": float(tp.sum() / max(total, 1)),
        "macro_precision": float(precision[seen].mean()) if seen.any() else 0.0,
        "macro_recall": float(recall[seen].mean()) if seen.any() else 0.0,
        "macro_f1": float(f1[seen].mean()) if seen.any() else 0.0,
        "weighted_f1": float((f1 * support).sum() / max(support.sum(), 1)),
        "per_class": {
            str(name): {
                "precision": float(precision[i]),
                "recall": float(recall[i]),
                "f1": float(f1[i]),
                "support": int(support[i]),
            }
            for i, name in enumerate(names)
        },
        "confusion_matrix": c.astype(np.int64).tolist(),
    }


def ranking_report(labels: Any, scores: Any) -> dict[str, float]:
    """Threshold-free metrics of a binary task: ``auroc`` (the Mann-Whitney statistic, ties
    counted half, as ``sklearn.metrics.roc_auc_score``) and ``average_precision`` (as
    ``sklearn.metrics.average_precision_score``); NaN when only one class occurs."""
    y = np.asarray(labels).astype(bool)
    s = np.asarray(scores, dtype=np.float64)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return {"auroc": math.nan, "average_precision": math.nan}
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), dtype=np.float64)
    sorted_s = s[order]
    # average ranks over ties (1-based)
    _, first, counts = np.unique(sorted_s, return_index=True, return_counts=True)
    avg = first + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    auroc = (ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)
    # average precision: thresholds at each distinct score, from the highest down
    desc = np.argsort(-s, kind="mergesort")
    s_desc, y_desc = s[desc], y[desc]
    last = np.r_[np.nonzero(np.diff(s_desc))[0], len(s_desc) - 1]  # end of each tie group
    tps = np.cumsum(y_desc)[last]
    fps = (last + 1) - tps
    precision = tps / (tps + fps)
    recall = tps / n_pos
    ap = float(np.sum(np.diff(np.r_[0.0, recall]) * precision))
    return {"auroc": float(auroc), "average_precision": ap}


def compute_head_metrics(
    cfg: HeadConfig, preds: Any, labels: Any, attention_mask: Any | None = None
) -> dict[str, float]:
    """The metrics of one head over whole arrays (see the module docstring for which)."""
    return HeadMetric(cfg).update(preds, labels, attention_mask).compute()


class HeadwiseMetrics:
    """A ``compute_metrics`` for ``transformers.Trainer``: reports ``<head>_<metric>`` (logged
    as ``eval_<head>_<metric>``) for every head that has a loss and labels. Reads predictions
    as ``{head: array}`` and labels as ``{target: array}``, or, for a model with one head that
    has a loss, that head's arrays (what Trainer and HeadedTrainer then pass).
    """

    def __init__(self, model: Any) -> None:
        self.head_configs: dict[str, HeadConfig] = dict(model.head_configs)
        self._trained = loss_heads(self.head_configs)
        self._meters: dict[str, HeadMetric] | None = None

    def __call__(self, eval_pred: Any, compute_result: bool = True) -> dict[str, float]:
        """Metrics of ``eval_pred``; with Trainer's ``batch_eval_metrics=True`` batches
        accumulate until ``compute_result=True``."""
        preds, labels = eval_pred.predictions, eval_pred.label_ids
        if isinstance(preds, (tuple, list)):
            dicts = [p for p in preds if isinstance(p, Mapping)]
            preds = dicts[-1] if dicts else preds[0]
        if len(self._trained) == 1 and not isinstance(preds, Mapping):
            preds = {self._trained[0]: preds}  # the one trained head's plain arrays
            labels = None if labels is None else {"labels": labels}
        if isinstance(labels, Mapping):
            labels = route_labels(self.head_configs, dict(labels))
        if not isinstance(preds, Mapping) or not isinstance(labels, Mapping):
            raise BatchError(
                "HeadwiseMetrics: predictions and label_ids must be dicts by head and by target "
                f"(got {type(preds).__name__} and {type(labels).__name__}); collate with "
                "HeadedCollator, which puts labels under batch['labels']"
            )
        if self._meters is None:
            self._meters = {n: HeadMetric(self.head_configs[n]) for n in self._trained}
        try:
            for name, meter in self._meters.items():
                y = labels.get(self.head_configs[name].target)
                if name in preds and y is not None:
                    meter.update(preds[name], y)
        except Exception:
            self._meters = None  # a failed evaluation must not leak into the next one
            raise
        if not compute_result:
            return {}
        meters, self._meters = self._meters, None
        return {
            f"{name}_{metric}": value
            for name, meter in meters.items()
            for metric, value in meter.compute().items()
        }


def evaluate_head_wise(
    model: Any,
    data: Iterable[Any],
    collator: Any = None,
    batch_size: int = 8,
    epochs: float = 1.0,
    *,
    progress: bool = True,
) -> dict[str, dict[str, float]]:
    """Evaluate every head that has labels in ``data`` → ``{head: {metric: value}}``.

    ``data``: a DataLoader (its batches are used as they are) or a dataset / list of feature
    dicts, batched by ``collator`` (default ``HeadedCollator(model)``); the model sees exactly
    the collator's batches. ``epochs`` < 1 evaluates that fraction of the batches (the first
    ``ceil(epochs × batches)``); ``headkit.compat.evaluate_head_wise`` reads the same batches
    into ``(mean loss, {head: mean loss})``. Columns that are neither model inputs
    nor head targets are dropped first, as Trainer does, with a warning naming them. Each head
    also gets ``loss``: its loss averaged over the examples of the batches that had its labels.
    """
    configs: dict[str, HeadConfig] = dict(model.head_configs)
    meters = {n: HeadMetric(c) for n, c in configs.items()}
    loss_sums = dict.fromkeys(configs, 0.0)
    counts = dict.fromkeys(configs, 0)
    targets = {c.target for c in configs.values()}
    for batch, out in evaluation_batches(model, data, collator, batch_size, epochs, progress):
        labels = route_labels(
            configs, {k: v for k, v in batch.items() if k == "labels" or k in targets}
        )
        mask = batch.get("attention_mask")
        n = next((int(v.shape[0]) for v in out.preds_by_head.values()), 1)  # examples
        for name, cfg in configs.items():
            y = labels.get(cfg.target)
            if y is None:
                continue
            meters[name].update(out.preds_by_head[name].cpu(), y.cpu(), _cpu(mask))
            if name in out.loss_by_head:
                loss_sums[name] += float(out.loss_by_head[name]) * n
                counts[name] += n
    results: dict[str, dict[str, float]] = {}
    for name in configs:
        values = meters[name].compute()
        if counts[name]:
            values = {"loss": loss_sums[name] / counts[name], **values}
        if values:
            results[name] = values
    return results


def evaluation_batches(
    model: Any,
    data: Iterable[Any],
    collator: Any = None,
    batch_size: int = 8,
    epochs: float = 1.0,
    progress: bool = True,
) -> Iterator[tuple[dict[str, Any], Any]]:
    """``(batch, model output)`` for each evaluation batch, in eval mode without gradients
    (the model's mode is restored after): the batches are the DataLoader's, or ``collator``'s
    (default ``HeadedCollator(model)``) over ``data``; ``epochs`` < 1 stops after that fraction."""
    if isinstance(data, DataLoader):
        loader: Any = data
    else:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise BatchError(f"evaluate_head_wise: batch_size={batch_size!r} is invalid; >= 1")
        if collator is None:
            from .data.collator import HeadedCollator

            collator = HeadedCollator(model)
        own = getattr(getattr(model, "info", None), "extra_inputs", ())
        own = (*own, *getattr(collator, "columns", ()))  # e.g. PreferenceCollator's pairs
        data = keep_model_columns(data, model.head_configs, "evaluate_head_wise", own)
        loader = DataLoader(data, batch_size=batch_size, shuffle=False, collate_fn=collator)
    if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not epochs > 0:
        raise BatchError(f"evaluate_head_wise: epochs={epochs!r} is invalid; a number > 0")
    limit = None
    if epochs < 1 and hasattr(loader, "__len__"):
        limit = max(1, math.ceil(epochs * len(loader)))
    configs = list(model.head_configs.values())
    was_training = model.training
    device = model.device
    model.eval()
    try:
        with torch.no_grad():
            batches = tqdm(loader, total=limit, desc="evaluate", disable=not progress)
            for i, batch in enumerate(batches):
                if limit is not None and i >= limit:
                    break
                batch = batch_to_device(batch, device)
                # labels only loss-free heads read serve their metrics, not the model call
                yield batch, model(**without_unused_labels(batch, configs))
    finally:
        model.train(was_training)


# ---------------------------------------------------------------------- helpers
def _tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    return torch.as_tensor(np.asarray(x))


def _cpu(x: Any) -> Any:
    return x.cpu() if isinstance(x, torch.Tensor) else x


def batch_to_device(batch: Any, device: torch.device) -> Any:
    """A batch (tensors, and mappings of them such as ``labels={target: tensor}``) on
    ``device``; anything else as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: batch_to_device(v, device) for k, v in batch.items()}
    return batch
