"""Per-head evaluation metrics.

Which metrics a head gets follows its config: causal-LM heads → ``perplexity`` (exp of the
shifted cross-entropy, as the head's loss computes it); regression heads → ``mse``, ``mae``,
``r2`` (averaged over outputs, as sklearn's ``multioutput="uniform_average"``); binary heads
(``bce``/``bce_with_logits``) → element-wise ``accuracy`` and ``macro_f1`` (the positive-class
F1 averaged over outputs); other heads → ``accuracy`` and ``macro_f1`` over the classes that
occur in labels or predictions (sklearn's ``average="macro"``).

Label value -100 never counts (it marks ignored and padded positions; the collator and
Trainer pad with it), and with an attention mask neither do padded tokens of heads with
``ignore_pads``. Statistics accumulate batch by batch, so nothing is kept per example.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from .config import HeadConfig
from .errors import BatchError
from .losses import IGNORE_INDEX

_BINARY_LOSSES = {"bce": 0.5, "bce_with_logits": 0.0}  # loss → decision threshold


def head_kind(cfg: HeadConfig) -> str:
    """ "lm", "regression", "binary" or "classification": which metrics the head gets."""
    if cfg.is_causal_lm:
        return "lm"
    if cfg.is_regression:
        return "regression"
    if cfg.loss_fct in _BINARY_LOSSES:
        return "binary"
    return "classification"


class HeadMetric:
    """Streaming metrics of one head: ``update(preds, labels, mask)`` per batch, then
    ``compute()`` → {metric: value}. preds: (batch, n) or (batch, seq, n)."""

    def __init__(self, cfg: HeadConfig) -> None:
        self.cfg = cfg
        self.kind = head_kind(cfg)
        n = int(cfg.num_outputs or 1)
        self.n = n
        if self.kind == "classification":
            self.confusion = np.zeros((n, n), dtype=np.int64)  # [label, prediction]
        elif self.kind == "binary":
            self.counts = np.zeros((n, 4), dtype=np.int64)  # tp, fp, fn, tn per output
        elif self.kind == "regression":
            self.sums = np.zeros((n, 5), dtype=np.float64)  # count, Σy, Σy², Σe², Σ|e|
        else:
            self.nll = 0.0
            self.tokens = 0

    # ------------------------------------------------------------------ update
    def update(self, preds: Any, labels: Any, attention_mask: Any | None = None) -> HeadMetric:
        """Add one batch. ``attention_mask`` (batch, seq) masks padded tokens."""
        p = _tensor(preds)
        y = _tensor(labels)
        cfg = self.cfg
        lead = p.shape[:-1]  # (batch,) or (batch, seq)
        valid = torch.ones(lead, dtype=torch.bool)
        if attention_mask is not None and not cfg.pred_for_sequence and cfg.ignore_pads:
            m = _tensor(attention_mask).bool()
            if tuple(m.shape) != tuple(lead):
                raise BatchError(
                    f"head {cfg.name!r}: attention_mask of shape {tuple(m.shape)} does not match "
                    f"its predictions {tuple(p.shape)}"
                )
            valid = m
        if self.kind in ("classification", "lm"):
            if tuple(y.shape) != tuple(lead):
                raise _shape_error(cfg, y, [tuple(lead)])
            y = y.long()
            if self.kind == "lm":  # position t predicts token t+1
                p, y, valid = p[:, :-1], y[:, 1:], valid[:, 1:]
            valid = valid & (y != IGNORE_INDEX)
            if self.kind == "lm":
                self._update_lm(p, y, valid)
            else:
                self._update_classes(p, y, valid)
            return self
        if y.dim() == len(lead):
            y = y.unsqueeze(-1)
        if tuple(y.shape) != tuple(p.shape):
            raise _shape_error(cfg, y, [tuple(p.shape)] + ([tuple(lead)] if self.n == 1 else []))
        y = y.double()
        elem = valid.unsqueeze(-1).expand_as(y) & (y != IGNORE_INDEX) & torch.isfinite(y)
        p = p.double().reshape(-1, self.n)
        y = y.reshape(-1, self.n)
        elem = elem.reshape(-1, self.n)
        if self.kind == "binary":
            hat = p > _BINARY_LOSSES[cfg.loss_fct]
            pos = y > 0.5
            for j, cell in enumerate((hat & pos, hat & ~pos, ~hat & pos, ~hat & ~pos)):
                self.counts[:, j] += (cell & elem).sum(0).numpy()  # tp, fp, fn, tn
        else:
            zero = torch.zeros_like(y)
            yv = torch.where(elem, y, zero)
            e = torch.where(elem, p - y, zero)
            self.sums[:, 0] += elem.sum(0).double().numpy()
            self.sums[:, 1] += yv.sum(0).numpy()
            self.sums[:, 2] += (yv * yv).sum(0).numpy()
            self.sums[:, 3] += (e * e).sum(0).numpy()
            self.sums[:, 4] += e.abs().sum(0).numpy()
        return self

    def _update_classes(self, p: torch.Tensor, y: torch.Tensor, valid: torch.Tensor) -> None:
        y = y[valid]
        hat = p[valid].argmax(-1)
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
            c = self.confusion
            total = c.sum()
            if total == 0:
                return {}
            tp = np.diag(c).astype(np.float64)
            fp = c.sum(0) - tp
            fn = c.sum(1) - tp
            seen = (c.sum(0) + c.sum(1)) > 0
            f1 = 2 * tp[seen] / (2 * tp[seen] + fp[seen] + fn[seen])
            return {"accuracy": float(tp.sum() / total), "macro_f1": float(f1.mean())}
        if self.kind == "binary":
            tp, fp, fn, tn = (self.counts[:, j].astype(np.float64) for j in range(4))
            total = (tp + fp + fn + tn).sum()
            if total == 0:
                return {}
            denom = 2 * tp + fp + fn
            f1 = np.where(denom > 0, 2 * tp / np.maximum(denom, 1), 0.0)
            return {"accuracy": float((tp + tn).sum() / total), "macro_f1": float(f1.mean())}
        if self.kind == "regression":
            n, sy, syy, see, sae = (self.sums[:, j] for j in range(5))
            cols = n > 0
            if not cols.any():
                return {}
            n, sy, syy, see, sae = n[cols], sy[cols], syy[cols], see[cols], sae[cols]
            ss_tot = syy - sy * sy / n
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


def compute_head_metrics(
    cfg: HeadConfig, preds: Any, labels: Any, attention_mask: Any | None = None
) -> dict[str, float]:
    """The metrics of one head over whole arrays (see the module docstring for which)."""
    return HeadMetric(cfg).update(preds, labels, attention_mask).compute()


class HeadwiseMetrics:
    """A ``compute_metrics`` for ``transformers.Trainer``: reports ``<head>_<metric>`` (logged
    as ``eval_<head>_<metric>``). Reads predictions as ``{head: array}`` (HeadedTrainer) or the
    vanilla Trainer's tuple, whose last dict is ``preds_by_head``; labels as ``{target: array}``.
    """

    def __init__(self, model: Any) -> None:
        self.head_configs: dict[str, HeadConfig] = dict(model.head_configs)
        self._meters: dict[str, HeadMetric] | None = None

    def __call__(self, eval_pred: Any, compute_result: bool = True) -> dict[str, float]:
        """Metrics of ``eval_pred``; with Trainer's ``batch_eval_metrics=True`` batches
        accumulate until ``compute_result=True``."""
        preds, labels = eval_pred.predictions, eval_pred.label_ids
        if isinstance(preds, (tuple, list)):
            dicts = [p for p in preds if isinstance(p, Mapping)]
            preds = dicts[-1] if dicts else None
        if not isinstance(preds, Mapping) or not isinstance(labels, Mapping):
            raise BatchError(
                "HeadwiseMetrics: predictions and label_ids must be dicts by head and by target "
                f"(got {type(preds).__name__} and {type(labels).__name__}); collate with "
                "HeadedCollator, which puts labels under batch['labels']"
            )
        if self._meters is None:
            self._meters = {n: HeadMetric(c) for n, c in self.head_configs.items()}
        try:
            for name, cfg in self.head_configs.items():
                if name in preds and labels.get(cfg.target) is not None:
                    self._meters[name].update(preds[name], labels[cfg.target])
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
    *,
    collator: Any = None,
    batch_size: int = 8,
    progress: bool = True,
) -> dict[str, dict[str, float]]:
    """Evaluate every head that has labels in ``data`` → ``{head: {metric: value}}``.

    ``data``: a DataLoader (its batches are used as they are) or a dataset / list of feature
    dicts, batched with ``collator`` (default ``HeadedCollator(model)``). Each head also gets
    ``loss``: its loss averaged over the examples of the batches that had its labels.
    """
    if isinstance(data, DataLoader):
        loader: Iterable[Any] = data
    else:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise BatchError(f"evaluate_head_wise: batch_size={batch_size!r} is invalid; >= 1")
        if collator is None:
            from .data import HeadedCollator

            collator = HeadedCollator(model)
        loader = DataLoader(data, batch_size=batch_size, shuffle=False, collate_fn=collator)
    configs: dict[str, HeadConfig] = dict(model.head_configs)
    meters = {n: HeadMetric(c) for n, c in configs.items()}
    loss_sums = dict.fromkeys(configs, 0.0)
    counts = dict.fromkeys(configs, 0)
    was_training = model.training
    device = model.device
    model.eval()
    try:
        with torch.no_grad():
            for batch in tqdm(loader, desc="evaluate", disable=not progress):
                batch = _to_device(batch, device)
                out = model(**batch)
                labels = batch.get("labels")
                if not isinstance(labels, Mapping):
                    labels = {
                        c.target: batch[c.target] for c in configs.values() if c.target in batch
                    }
                mask = batch.get("attention_mask")
                n = int(batch["input_ids"].shape[0]) if "input_ids" in batch else 1
                for name, cfg in configs.items():
                    y = labels.get(cfg.target)
                    if y is None:
                        continue
                    meters[name].update(out.preds_by_head[name].cpu(), y.cpu(), _cpu(mask))
                    if name in out.loss_by_head:
                        loss_sums[name] += float(out.loss_by_head[name]) * n
                        counts[name] += n
    finally:
        model.train(was_training)
    results: dict[str, dict[str, float]] = {}
    for name in configs:
        values = meters[name].compute()
        if counts[name]:
            values = {"loss": loss_sums[name] / counts[name], **values}
        if values:
            results[name] = values
    return results


# ---------------------------------------------------------------------- helpers
def _tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    return torch.as_tensor(np.asarray(x))


def _cpu(x: Any) -> Any:
    return x.cpu() if isinstance(x, torch.Tensor) else x


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


def _shape_error(cfg: HeadConfig, y: torch.Tensor, expected: list[tuple]) -> BatchError:
    return BatchError(
        f"head {cfg.name!r} (target {cfg.target!r}): labels of shape {tuple(y.shape)} do not "
        f"fit its predictions; expected {' or '.join(str(e) for e in expected)}"
    )
