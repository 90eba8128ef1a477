"""The epochs of ``headkit train``: a validation split, the optimiser and its controls, early
stopping on a named metric, the best weights kept, logs, and resuming.

``validation_fraction`` of the examples (drawn with ``seed``) are held out. After each epoch
the validation loss (the model's total loss, as ``HeadedModel.forward`` combines the heads')
and every head's metrics are measured; when ``metric_for_best_model`` (``loss``, a metric
averaged over the heads that have it, or ``<head>_<metric>``) has not improved for
``patience`` epochs training stops, and the trainable weights of the best epoch are
restored. With ``validation_fraction: 0`` every epoch runs and the last weights are kept.
With a frozen backbone the heads train on cached features (one backbone pass over the
training and the validation rows); otherwise epochs run through the whole model.

The optimiser is AdamW (``lr``, ``weight_decay``) with an lr schedule (``lr_schedule``:
constant, linear or cosine decay to 0, after ``warmup_ratio`` / ``warmup_steps`` of linear
warm-up), gradient clipping (``max_grad_norm``), accumulation
(``gradient_accumulation_steps``) and, through the whole model, bf16 / fp16 autocast. After
every epoch the training state (trainable weights, the optimiser and schedule, the best
epoch's weights, the history) is written to ``OUTPUT/training_state`` (safetensors and JSON),
from which ``resume`` continues; ``report_to`` logs each epoch to ``OUTPUT/logs`` (CSV,
TensorBoard).
"""

from __future__ import annotations

import csv
import json
import math
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..data.collator import HeadedCollator
from ..errors import ConfigError
from ..features import (
    CachedFeatures,
    cache_features,
    features_given,
    predict_on_features,
    train_heads_on_features,
)
from ..features.train import OptimizerSteps
from ..losses.objective import head_loss
from ..metrics import HeadMetric, batch_to_device
from ..model.headed import HeadedModel
from ..model.rates import HEAD_LR, param_groups
from .train_config import LOG_FOLDER, STATE_FOLDER

#: A validation score counts as better when it improves by more than this share.
MIN_IMPROVEMENT = 1e-4
#: Metrics for which lower is better (besides ``loss``).
LOWER_IS_BETTER = ("loss", "mse", "mae", "perplexity")


@dataclass
class Fit:
    """What training did: the mean training loss and the validation loss of each epoch, the
    epoch whose weights were kept (from 1; None without validation), whether early
    stopping ended it before ``epochs``, each epoch's validation metrics, the epoch it
    resumed after (0: a fresh start) and the optimizer steps taken."""

    losses: list[float] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)
    best_epoch: int | None = None
    stopped_early: bool = False
    val_metrics: list[dict[str, float]] = field(default_factory=list)
    resumed_after: int = 0
    steps: int = 0


def fit_heads(
    model: HeadedModel,
    tokenizer: Any,
    examples: list[dict],
    training: dict[str, Any],
    progress: bool = True,
    collator: Any = None,
    output: str | Path | None = None,
    resume: bool = False,
    features: dict[str, torch.Tensor] | None = None,
) -> Fit:
    """Train ``model`` on ``examples`` with the settings of a train config's ``training``
    section. ``collator`` (default ``HeadedCollator``) batches the examples; with one, they
    train through the model (a ``PreferenceCollator``'s pairs cannot be cached: rows would be
    shuffled apart). ``output``: the checkpoint folder, where the training state and logs go
    (None: neither); ``resume``: continue from the state there. ``features``: {head:
    (len(examples), width)} pooled features already computed for every example (a probe
    sweep's): the heads train on them and the backbone does not run (``features_given``)."""
    train_rows, val_rows = validation_split(
        len(examples), training["validation_fraction"], training["seed"]
    )
    train_set = [examples[i] for i in train_rows]
    val_set = [examples[i] for i in val_rows]
    lr = float(training["lr"])
    # a trained backbone at training.lr, fresh heads at least at HEAD_LR (model/rates.py);
    # weight decay (AdamW's own default 0.01) on weight matrices only
    head_lr = lr if training["freeze_backbone"] else max(HEAD_LR, lr)
    decay = float(training.get("weight_decay", 0.01))
    groups = param_groups(model, head_lr=head_lr, backbone_lr=lr, weight_decay=decay)
    opt = torch.optim.AdamW(groups)
    size = training["batch_size"]
    accumulation = int(training.get("gradient_accumulation_steps", 1))
    per_epoch = math.ceil(math.ceil(len(train_set) / size) / accumulation)
    scheduler = make_scheduler(opt, training, per_epoch * training["epochs"])
    precision = autocast_dtype(model, training)
    scaler = None
    if precision == torch.float16:
        scaler = torch.amp.GradScaler(model.device.type)
    steps = OptimizerSteps(opt, scheduler, training.get("max_grad_norm"), accumulation, scaler)
    cached = training["use_cached_features"] in (True, "auto") and training["freeze_backbone"]
    cached = cached and collator is None
    if features is not None and not cached:
        raise ConfigError(
            "features (pooled features computed earlier) need cached training: "
            "training.freeze_backbone=true, use_cached_features true or auto, and "
            "classification or regression data"
        )
    wrong = {h: tuple(x.shape) for h, x in (features or {}).items() if x.shape[0] != len(examples)}
    if wrong:
        raise ConfigError(
            f"features of shape {wrong} do not match the {len(examples)} training examples; "
            "one row per example, in order",
            field="features",
            value=sorted(wrong),
        )
    if features is not None:
        train_index, val_index = torch.tensor(train_rows), torch.tensor(val_rows)
        feats = features_given(model, train_set, {h: x[train_index] for h, x in features.items()})
        val_feats = (
            features_given(model, val_set, {h: x[val_index] for h, x in features.items()})
            if val_set
            else None
        )
    elif cached:
        with _autocast(model, precision):
            feats = cache_features(model, train_set, batch_size=size, progress=progress)
            val_feats = (
                cache_features(model, val_set, batch_size=size, progress=False) if val_set else None
            )
    if cached:

        def epoch(e: int) -> float:
            (loss,) = train_heads_on_features(
                model, feats, epochs=1, batch_size=size, seed=training["seed"] + e, steps=steps
            )
            return loss

        validate = (lambda: cached_scores(model, val_feats)) if val_feats is not None else None
    else:
        epoch, validate = _full_epochs(
            model, tokenizer, train_set, val_set, training, steps, precision, collator
        )
    state = TrainingState(Path(output) / STATE_FOLDER, model, steps) if output else None
    logger = EpochLog(Path(output) / LOG_FOLDER, training.get("report_to", [])) if output else None
    start = state.load() if (resume and state is not None) else None
    try:
        return early_stopping(
            model,
            epoch,
            validate,
            training["epochs"],
            training["patience"],
            progress,
            metric=training.get("metric_for_best_model", "loss"),
            greater_is_better=training.get("greater_is_better"),
            after_epoch=_after_epoch(state, logger, opt),
            start=start,
        )
    finally:
        model.eval()
        if logger is not None:
            logger.close()


def validation_split(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training rows, validation rows) of ``n`` examples: ``fraction`` of them (at least
    one, and leaving at least one to train on) drawn with ``seed``; none when ``fraction``
    is 0 or ``n`` < 2."""
    if fraction <= 0 or n < 2:
        return list(range(n)), []
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = min(max(1, round(n * fraction)), n - 1)
    return sorted(order[n_val:]), sorted(order[:n_val])


def early_stopping(
    model: torch.nn.Module,
    epoch: Callable[[int], float],
    validate: Callable[[], float | dict[str, float]] | None,
    epochs: int,
    patience: int,
    progress: bool = True,
    *,
    metric: str = "loss",
    greater_is_better: bool | None = None,
    after_epoch: Callable[[int, Fit, dict | None], None] | None = None,
    start: tuple[Fit, dict | None] | None = None,
) -> Fit:
    """Run ``epoch(e)`` (returns its mean training loss) up to ``epochs`` times; with
    ``validate`` (returns the validation loss, or a dict of ``loss`` and metrics), stop after
    ``patience`` epochs without a better ``metric`` and restore the trainable weights of the
    best epoch. ``after_epoch(e, fit, kept)`` runs after each epoch (state, logs);
    ``start`` = (the Fit so far, the best weights so far) resumes."""
    fit, kept = start if start is not None else (Fit(), None)
    higher = greater_is_better if greater_is_better is not None else not _lower(metric)
    sign = -1.0 if higher else 1.0  # compare sign * score: lower is better
    best = min(
        (sign * _score(m, metric) for m in fit.val_metrics[: fit.best_epoch or 0][-1:]),
        default=math.inf,
    )
    first = len(fit.losses)
    bar = tqdm(range(first, epochs), desc="headkit: training heads", disable=not progress)
    for e in bar:
        fit.losses.append(epoch(e))
        if validate is None:
            bar.set_postfix(loss=f"{fit.losses[-1]:.4f}")
            if after_epoch is not None:
                after_epoch(e, fit, kept)
            continue
        scores = validate()
        scores = scores if isinstance(scores, dict) else {"loss": scores}
        fit.val_losses.append(scores["loss"])
        fit.val_metrics.append(scores)
        value = sign * _score(scores, metric)
        bar.set_postfix(loss=f"{fit.losses[-1]:.4f}", val=f"{scores['loss']:.4f}")
        better_than = best - MIN_IMPROVEMENT * abs(best) if math.isfinite(best) else best
        if value < better_than:
            best, fit.best_epoch = value, e + 1
            kept = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        stop = e + 1 - (fit.best_epoch or 0) >= patience
        if stop:
            fit.stopped_early = e + 1 < epochs
        if after_epoch is not None:
            after_epoch(e, fit, kept)
        if stop:
            break
    bar.close()
    if kept is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in kept:
                    p.copy_(kept[name])
    return fit


def _lower(metric: str) -> bool:
    return metric.rpartition("_")[2] in LOWER_IS_BETTER or metric in LOWER_IS_BETTER


def _score(scores: dict[str, float], metric: str) -> float:
    """The value of ``metric`` in one epoch's validation scores: ``loss``, ``<head>_<name>``
    or ``<name>`` averaged over the heads that report it."""
    if metric in scores:
        return scores[metric]
    values = [v for k, v in scores.items() if k.endswith(f"_{metric}")]
    if not values:
        raise ConfigError(
            f"training.metric_for_best_model={metric!r} is not measured on validation; "
            f"measured: {', '.join(sorted(scores))}"
        )
    return sum(values) / len(values)


# ---------------------------------------------------------------------- the optimiser
def make_scheduler(
    opt: torch.optim.Optimizer, training: dict[str, Any], total: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The lr schedule over ``total`` optimizer steps: linear warm-up over ``warmup_steps``
    (or ``warmup_ratio`` of the steps), then constant, linear or cosine decay to 0."""
    kind = training.get("lr_schedule", "constant")
    warmup = int(training.get("warmup_steps") or 0)
    if not warmup and training.get("warmup_ratio"):
        warmup = math.ceil(total * float(training["warmup_ratio"]))
    total = max(total, 1)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def autocast_dtype(model: HeadedModel, training: dict[str, Any]) -> torch.dtype | None:
    """bf16 / fp16 autocast for the training passes, or None; fp16 needs a CUDA device."""
    if training.get("fp16"):
        if model.device.type != "cuda":
            raise ConfigError(
                f"training.fp16=true needs a CUDA GPU (the model is on {model.device.type}); "
                "allowed on this device: bf16: true, or neither"
            )
        return torch.float16
    if training.get("bf16"):
        return torch.bfloat16
    return None


class _autocast:
    """``torch.autocast`` on the model's device with ``dtype``, or nothing (None)."""

    def __init__(self, model: HeadedModel, dtype: torch.dtype | None) -> None:
        self.ctx = torch.autocast(model.device.type, dtype=dtype) if dtype is not None else None

    def __enter__(self) -> None:
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


# ---------------------------------------------------------------------- validation
@torch.no_grad()
def cached_scores(model: HeadedModel, features: CachedFeatures) -> dict[str, float]:
    """The model's total validation ``loss`` over cached features (heads in eval mode), as
    ``forward`` combines the heads' losses, and each head's metrics as ``<head>_<metric>``."""
    preds = predict_on_features(model, features)
    labels = features.labels
    losses, scores = {}, {}
    for name, cfg in model.head_configs.items():
        if cfg.loss_fct is None or cfg.target not in labels:
            continue
        p, y = preds[name], labels[cfg.target]
        if not cfg.pred_for_sequence:  # (tokens, n): one sequence of every stored token
            p, y = p[None], y[None]
        losses[name] = head_loss(cfg, p.to(model.device), y.to(model.device), None)
        scores[f"{name}_loss"] = float(losses[name])
        for metric, value in HeadMetric(cfg).update(p, y).compute().items():
            scores[f"{name}_{metric}"] = value
    total, _ = model.combine_losses(losses)
    return {"loss": float(total) if total is not None else math.nan, **scores}


def cached_loss(model: HeadedModel, features: CachedFeatures) -> float:
    """The model's total loss over cached features (``cached_scores``' ``loss``)."""
    return cached_scores(model, features)["loss"]


def _full_epochs(
    model: HeadedModel,
    tokenizer: Any,
    train_set: list[dict],
    val_set: list[dict],
    training: dict[str, Any],
    steps: OptimizerSteps,
    precision: torch.dtype | None,
    collator: Any = None,
) -> tuple[Callable[[int], float], Callable[[], dict[str, float]] | None]:
    """(one epoch, the validation scores) through the whole model (the backbone trains unless
    frozen)."""
    from torch.utils.data import DataLoader

    from ..metrics import evaluate_head_wise

    torch.manual_seed(training["seed"])
    collate = collator or HeadedCollator(model, tokenizer)
    size = training["batch_size"]

    def epoch(e: int) -> float:
        # each epoch's order from its own seed, so that a resumed run draws the same batches
        g = torch.Generator().manual_seed(training["seed"] * 1_000_003 + e)
        loader = DataLoader(
            train_set, batch_size=size, shuffle=True, generator=g, collate_fn=collate
        )
        model.train()
        total, n = 0.0, 0
        steps.optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(loader):
            with _autocast(model, precision):
                out = model(**batch_to_device(batch, model.device))
            steps.backward(out.loss, last=i == len(loader) - 1)
            total, n = total + float(out.loss.detach()), n + 1
        return total / max(n, 1)

    @torch.no_grad()
    def pair_loss() -> dict[str, float]:  # reward pairs: the loss alone (rows are pairs)
        model.eval()
        total = 0.0
        for start in range(0, len(val_set), size):
            chunk = val_set[start : start + size]
            with _autocast(model, precision):
                out = model(**batch_to_device(collate(chunk), model.device))
            total += float(out.loss) * len(chunk)
        return {"loss": total / len(val_set)}

    def validate() -> dict[str, float]:
        if collator is not None:
            return pair_loss()
        with _autocast(model, precision):
            per_head = evaluate_head_wise(model, val_set, collate, batch_size=size, progress=False)
        scores = {f"{h}_{m}": v for h, ms in per_head.items() for m, v in ms.items()}
        losses = {h: torch.tensor(ms["loss"]) for h, ms in per_head.items() if "loss" in ms}
        total, _ = model.combine_losses(losses)
        return {"loss": float(total) if total is not None else math.nan, **scores}

    return epoch, (validate if val_set else None)


# ---------------------------------------------------------------------- state and logs
class TrainingState:
    """The state a run resumes from, written after every epoch into ``folder``: the
    trainable weights, the best epoch's weights, the optimiser's tensors (safetensors), and
    the history, the schedule's step and the optimiser's settings (JSON)."""

    def __init__(self, folder: Path, model: torch.nn.Module, steps: OptimizerSteps) -> None:
        self.folder, self.model, self.steps = folder, model, steps

    def save(self, fit: Fit, kept: dict | None) -> None:
        from safetensors.torch import save_file

        from .outputs import write_text

        opt = self.steps.optimizer.state_dict()
        tensors = {
            f"weight.{n}": p.detach().cpu().contiguous()
            for n, p in self.model.named_parameters()
            if p.requires_grad
        }
        tensors.update({f"best.{n}": t.cpu().contiguous() for n, t in (kept or {}).items()})
        for index, values in opt["state"].items():
            for key, value in values.items():
                tensors[f"opt.{index}.{key}"] = torch.as_tensor(value).cpu().contiguous()
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / "state.safetensors.tmp"
        save_file(tensors, str(tmp))
        tmp.replace(self.folder / "state.safetensors")
        scheduler = self.steps.scheduler
        meta = {
            "fit": asdict(fit),
            "param_groups": opt["param_groups"],
            "scheduler_step": scheduler.last_epoch if scheduler is not None else 0,
            "optimizer_steps": self.steps.steps,
        }
        write_text(self.folder / "state.json", json.dumps(meta) + "\n")

    def load(self) -> tuple[Fit, dict | None] | None:
        """Restore the state written last (None when there is none: a fresh start)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        meta_path, weights = self.folder / "state.json", self.folder / "state.safetensors"
        if not meta_path.is_file() or not weights.is_file():
            return None
        where = f"training state {str(self.folder)!r}"
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            tensors = load_file(str(weights))
            fit = Fit(**meta["fit"])
            names = {n for n, p in self.model.named_parameters() if p.requires_grad}
            if {k[7:] for k in tensors if k.startswith("weight.")} != names:
                raise ValueError("its weights are not this model's trainable weights")
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    if n in names:
                        p.copy_(tensors[f"weight.{n}"])
            state: dict[int, dict[str, Any]] = {}
            for key, value in tensors.items():
                if key.startswith("opt."):
                    _, index, name = key.split(".", 2)
                    state.setdefault(int(index), {})[name] = value
            self.steps.optimizer.load_state_dict(
                {"state": state, "param_groups": meta["param_groups"]}
            )
            if self.steps.scheduler is not None:  # the lr of the step it stopped at
                self.steps.scheduler.last_epoch = int(meta["scheduler_step"]) - 1
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "step() before optimizer.step()"
                    self.steps.scheduler.step()
            self.steps.steps = int(meta["optimizer_steps"])
        except (ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as e:
            raise ConfigError(f"--resume: {where} cannot be read ({e}); train afresh") from None
        kept = {k[5:]: v for k, v in tensors.items() if k.startswith("best.")} or None
        fit.resumed_after = len(fit.losses)
        return fit, kept

    def remove(self) -> None:
        for name in ("state.safetensors", "state.json"):
            (self.folder / name).unlink(missing_ok=True)
        if self.folder.is_dir() and not any(self.folder.iterdir()):
            self.folder.rmdir()


class EpochLog:
    """Each epoch's training loss, lr and validation scores to ``folder``: ``metrics.csv``
    (``"csv"`` in ``report_to``) and TensorBoard event files (``"tensorboard"``)."""

    def __init__(self, folder: Path, report_to: list[str]) -> None:
        self.folder, self.report_to = folder, list(report_to)
        self.writer = None
        if "tensorboard" in self.report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError(
                    "training.report_to=['tensorboard'] needs the tensorboard package: "
                    "pip install tensorboard (or report_to: [csv])"
                ) from None
            self.writer = SummaryWriter(str(folder))

    def write(self, epoch: int, row: dict[str, float]) -> None:
        if "csv" in self.report_to:
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / "metrics.csv"
            rows = []
            if path.is_file():
                with open(path, newline="", encoding="utf-8") as f:
                    rows = [r for r in csv.DictReader(f) if int(r["epoch"]) < epoch]
            rows.append({"epoch": epoch, **row})
            columns = list(dict.fromkeys(k for r in rows for k in r))
            with open(path, "w", newline="", encoding="utf-8") as f:
                out = csv.DictWriter(f, fieldnames=columns)
                out.writeheader()
                out.writerows(rows)
        if self.writer is not None:
            for key, value in row.items():
                self.writer.add_scalar(key, value, epoch)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _after_epoch(
    state: TrainingState | None, logger: EpochLog | None, opt: torch.optim.Optimizer
) -> Callable[[int, Fit, dict | None], None] | None:
    if state is None and logger is None:
        return None

    def after(e: int, fit: Fit, kept: dict | None) -> None:
        if logger is not None and logger.report_to:
            row = {"train/loss": fit.losses[-1], "train/lr": float(opt.param_groups[0]["lr"])}
            if len(fit.val_metrics) == len(fit.losses):
                row.update({f"eval/{k}": v for k, v in fit.val_metrics[-1].items()})
            logger.write(e + 1, row)
        if state is not None:
            fit.steps = state.steps.steps
            state.save(fit, kept)

    return after
