"""Training and predicting heads on cached features (no backbone forward at all).

Each step computes exactly what ``HeadedModel.forward`` would: the heads' outputs
(``head_outputs``, or their trainable pooling on the stored token states), ``head_losses`` of
the heads, then ``model.combine_losses``.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from typing import Any

import torch
from tqdm.auto import tqdm

from ..backbone.fingerprint import tensors_fingerprint
from ..errors import ConfigError
from ..heads.stacked import head_outputs
from ..losses.objective import label_rule
from ..losses.shared import head_losses
from ..model.headed import HeadedModel
from .caching import _backbone_meta, _plan_heads, check_frozen
from .storage import CachedFeatures


def train_heads_on_features(
    model: HeadedModel,
    features: CachedFeatures,
    epochs: int = 1,
    batch_size: int = 32,
    lr: float = 1e-3,
    optimizer: torch.optim.Optimizer | None = None,
    seed: int = 0,
    max_steps: int | None = None,
    progress: bool = False,
    steps: OptimizerSteps | None = None,
) -> list[float]:
    """Train the heads on cached features; return the mean total loss of each epoch.

    Each step computes exactly what ``HeadedModel.forward`` would (``head_losses`` of the heads,
    then ``model.combine_losses``), with the heads in train mode (dropout active). Epoch e
    visits rows in the order ``torch.randperm(n, generator=g)`` (its e-th call) with ``g``
    seeded once by ``seed``, in consecutive batches; ``torch.manual_seed(seed)`` is set
    first for dropout. Default optimizer: AdamW(lr) over the trainable head (and loss
    weighting) parameters. ``max_steps`` stops early. ``steps`` (an ``OptimizerSteps``) takes
    over the optimizer steps: gradient accumulation, clipping and an lr schedule.
    """
    check_frozen(model)
    for field, value, low in (("epochs", epochs, 1), ("batch_size", batch_size, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"{field}={value!r} is invalid; an integer >= {low}")
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
        raise ConfigError(f"max_steps={max_steps!r} is invalid; an integer >= 1 or None")
    plan = _training_plan(model, features)
    if not plan:
        raise ConfigError(
            f"no head has both a loss_fct and cached labels; cached targets: "
            f"{sorted(features.meta['labels'])}, heads: {_head_targets(model)}"
        )
    if optimizer is None and steps is not None:
        optimizer = steps.optimizer
    if optimizer is None:
        params = [
            p
            for p in chain(model.heads.parameters(), model.loss_weighting.parameters())
            if p.requires_grad
        ]
        if not params:
            raise ConfigError("no head parameter requires grad (all heads trainable=False)")
        optimizer = torch.optim.AdamW(params, lr=lr)
    device = model.device
    n = len(features)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    modes = model.heads.training, model.loss_weighting.training
    model.heads.train()
    model.loss_weighting.train()
    epoch_losses: list[float] = []
    steps_taken = 0
    stepper = steps or OptimizerSteps(optimizer)
    stepper.optimizer.zero_grad(set_to_none=True)
    try:
        for epoch in range(epochs):
            order = torch.randperm(n, generator=generator)
            total, count = 0.0, 0
            starts = range(0, n, batch_size)
            bar = tqdm(starts, disable=not progress, desc=f"epoch {epoch + 1}/{epochs}")
            for start in bar:
                batch = features.batch(order[start : start + batch_size], device)
                loss = _batch_loss(model, plan, batch)
                if loss is None:
                    continue
                stepper.backward(loss, last=start + batch_size >= n)
                total += float(loss.detach())
                count += 1
                steps_taken += 1
                if max_steps is not None and steps_taken >= max_steps:
                    break
            epoch_losses.append(total / count if count else float("nan"))
            if max_steps is not None and steps >= max_steps:
                break
    finally:
        model.heads.train(modes[0])
        model.loss_weighting.train(modes[1])
    return epoch_losses


@torch.no_grad()
def predict_on_features(
    model: HeadedModel, features: CachedFeatures, batch_size: int = 256
) -> dict[str, torch.Tensor]:
    """Every head's predictions in eval mode, in cache order.

    Sequence heads: (num_sequences, num_outputs); token heads: (num_tokens, num_outputs),
    aligned with ``features.labels[target]``.
    """
    _check_matches(model, features, model.heads.keys())
    was = model.heads.training
    model.heads.eval()
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in model.heads}
    try:
        for start in range(0, len(features), batch_size):
            index = torch.arange(start, min(start + batch_size, len(features)))
            batch = features.batch(index, model.device)
            preds = _head_preds(model, {n: features.heads[n] for n in model.heads}, batch)
            for name, p in preds.items():
                if not model.head_configs[name].pred_for_sequence:
                    p = p[batch["mask"].bool()]
                parts[name].append(p.cpu())
    finally:
        model.heads.train(was)
    return {name: torch.cat(ps) for name, ps in parts.items()}


class OptimizerSteps:
    """How batches' losses become optimizer steps: ``backward(loss, last)`` after each batch
    accumulates ``accumulation_steps`` batches' gradients (each loss divided by their
    number), then clips the gradients' total norm to ``max_grad_norm`` (None: no clipping),
    steps the optimizer and the ``scheduler`` (per optimizer step) and clears the gradients;
    ``last`` (the epoch's last batch) steps whatever has accumulated. With a ``scaler``
    (``torch.amp.GradScaler``, for fp16) the loss is scaled and the step unscaled first."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        accumulation_steps: int = 1,
        scaler: Any = None,
    ) -> None:
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.accumulation_steps = accumulation_steps
        self.scaler = scaler
        self.pending = 0
        self.steps = 0  # optimizer steps taken

    def backward(self, loss: torch.Tensor, last: bool = False) -> None:
        scaled = loss / self.accumulation_steps
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        self.pending += 1
        if self.pending >= self.accumulation_steps or last:
            self.step()

    def step(self) -> None:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.pending = 0
        self.steps += 1


def _head_targets(model: HeadedModel) -> dict[str, str | None]:
    return {n: c.target for n, c in model.head_configs.items()}


def _check_matches(model: HeadedModel, features: CachedFeatures, names: Iterable[str]) -> None:
    """Raise ConfigError if the cache was made for different heads or another backbone."""
    if not isinstance(features, CachedFeatures):
        raise ConfigError(
            f"features must be CachedFeatures (from cache_features), got {type(features).__name__}"
        )
    cached_bb, bb = features.meta["backbone"], _backbone_meta(model, fingerprint=False)
    for field in ("class", "num_layers", "hidden_size"):
        if cached_bb[field] != bb[field]:
            raise ConfigError(
                f"features were cached from another backbone: {field}={cached_bb[field]!r}, "
                f"this model has {bb[field]!r}"
            )
    recorded = cached_bb.get("fingerprint")
    if recorded is not None and recorded != tensors_fingerprint(model.backbone):
        raise ConfigError(
            "features were cached from another backbone: its weights' fingerprint differs "
            "from this model's (same class and sizes, other weights); cache the features "
            "again with this model"
        )
    now = _plan_heads(model)
    for name in names:
        if name not in features.heads:
            raise ConfigError(
                f"head {name!r} has no cached features (cached heads: {sorted(features.heads)}); "
                "cache the features again after adding heads"
            )
        for field in ("layout", "layer", "pred_for_sequence", "pooling"):
            if features.heads[name][field] != now[name][field]:
                raise ConfigError(
                    f"head {name!r}: cached with {field}={features.heads[name][field]!r} but "
                    f"the model's head has {field}={now[name][field]!r}; cache the features again"
                )


def _training_plan(model: HeadedModel, features: CachedFeatures) -> dict[str, Any]:
    """Heads that get a loss, with the config their loss is computed with."""
    cached = features.meta["labels"]
    names = [
        n for n, c in model.head_configs.items() if c.loss_fct is not None and c.target in cached
    ]
    _check_matches(model, features, names)
    plan = {}
    for name in names:
        cfg = model.head_configs[name]
        if label_rule(cfg).task == "pairwise":
            raise ConfigError(
                f"head {name!r} has loss_fct={cfg.loss_fct!r}: its pairs are rows of one batch, "
                "and training on cached features shuffles rows; train it through the model "
                "(HeadedTrainer or forward, docs/rewards.md)"
            )
        if label_rule(cfg).layout == "token":
            # Rebuilt batches pad on the right, and caching checked that padding never counted
            # in this head's loss: ignoring padding gives the same loss as the original batches.
            cfg = cfg.replace(ignore_pads=True)
        plan[name] = (cfg, features.heads[name])
    return plan


def _head_preds(
    model: HeadedModel, infos: dict[str, dict[str, Any]], batch: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The predictions of the heads in ``infos`` (their cache entries), as ``forward`` makes
    them: ``head_outputs`` of the heads reading stored inputs (same-shape heads on one stored
    tensor as one matmul), the head itself where a trainable pooling runs on token states."""
    stored = {
        name: batch["features"][info["features"]]
        for name, info in infos.items()
        if info["layout"] == "pooled" or not info["pred_for_sequence"]
    }
    preds = head_outputs({name: model.heads[name] for name in stored}, stored)
    return {
        name: preds[name]
        if name in preds
        else model.heads[name](batch["features"][info["features"]], batch["mask"])
        for name, info in infos.items()
    }


def _batch_loss(
    model: HeadedModel, plan: dict[str, Any], batch: dict[str, Any]
) -> torch.Tensor | None:
    configs = {name: cfg for name, (cfg, _) in plan.items()}
    preds = _head_preds(model, {name: info for name, (_, info) in plan.items()}, batch)
    masks = dict.fromkeys(plan, batch["mask"])
    stack = model.nonfinite_loss != "skip"  # cached inputs need no gradient: as forward
    losses = head_losses(configs, preds, batch["labels"], masks, stack=stack)
    total, _ = model.combine_losses(losses)
    return total
