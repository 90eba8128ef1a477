"""The epochs of ``headkit train``: a validation split, early stopping, the best weights kept.

``validation_fraction`` of the examples (drawn with ``seed``) are held out. After each epoch
the validation loss (the model's total loss, as ``HeadedModel.forward`` combines the heads')
is measured; when it has not improved for ``patience`` epochs training stops, and the
trainable weights of the best epoch are restored. With ``validation_fraction: 0`` every epoch
runs and the last weights are kept. With a frozen backbone the heads train on cached features
(one backbone pass over the training and the validation rows); otherwise AdamW epochs run
through the whole model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from ..data.collator import HeadedCollator
from ..features import (
    CachedFeatures,
    cache_features,
    predict_on_features,
    train_heads_on_features,
)
from ..losses.objective import head_loss
from ..metrics import batch_to_device
from ..model.headed import HeadedModel
from ..model.rates import HEAD_LR, param_groups

#: A validation loss counts as better when it is lower by more than this share.
MIN_IMPROVEMENT = 1e-4


@dataclass
class Fit:
    """What training did: the mean training loss and the validation loss of each epoch, the
    epoch whose weights were kept (from 1; None without validation), and whether early
    stopping ended it before ``epochs``."""

    losses: list[float] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)
    best_epoch: int | None = None
    stopped_early: bool = False


def fit_heads(
    model: HeadedModel,
    tokenizer: Any,
    examples: list[dict],
    training: dict[str, Any],
    progress: bool = True,
    collator: Any = None,
) -> Fit:
    """Train ``model`` on ``examples`` with the settings of a train config's ``training``
    section (``epochs``, ``lr``, ``batch_size``, ``seed``, ``freeze_backbone``,
    ``use_cached_features``, ``validation_fraction``, ``patience``). ``collator`` (default
    ``HeadedCollator``) batches the examples; with one, they train through the model (a
    ``PreferenceCollator``'s pairs cannot be cached: rows would be shuffled apart)."""
    train_rows, val_rows = validation_split(
        len(examples), training["validation_fraction"], training["seed"]
    )
    train_set = [examples[i] for i in train_rows]
    val_set = [examples[i] for i in val_rows]
    lr = float(training["lr"])
    # a trained backbone at training.lr, fresh heads at least at HEAD_LR (model/rates.py)
    head_lr = lr if training["freeze_backbone"] else max(HEAD_LR, lr)
    groups = param_groups(model, head_lr=head_lr, backbone_lr=lr, weight_decay=0.01)
    opt = torch.optim.AdamW(groups)  # 0.01: AdamW's own default, on weight matrices only
    cached = training["use_cached_features"] in (True, "auto") and training["freeze_backbone"]
    cached = cached and collator is None
    if cached:
        size = training["batch_size"]
        feats = cache_features(model, train_set, batch_size=size, progress=progress)
        val_feats = (
            cache_features(model, val_set, batch_size=size, progress=False) if val_set else None
        )

        def epoch(e: int) -> float:
            (loss,) = train_heads_on_features(
                model, feats, epochs=1, batch_size=size, optimizer=opt, seed=training["seed"] + e
            )
            return loss

        validate = (lambda: cached_loss(model, val_feats)) if val_feats is not None else None
    else:
        epoch, validate = _full_epochs(
            model, tokenizer, train_set, val_set, training, opt, collator
        )
    try:
        return early_stopping(
            model, epoch, validate, training["epochs"], training["patience"], progress
        )
    finally:
        model.eval()


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
    model: HeadedModel,
    epoch: Callable[[int], float],
    validate: Callable[[], float] | None,
    epochs: int,
    patience: int,
    progress: bool = True,
) -> Fit:
    """Run ``epoch(e)`` (returns its mean training loss) up to ``epochs`` times; with
    ``validate`` (returns the validation loss), stop after ``patience`` epochs without a
    better one and restore the trainable weights of the best epoch."""
    fit = Fit()
    best, kept = math.inf, None
    bar = tqdm(range(epochs), desc="headkit: training heads", disable=not progress)
    for e in bar:
        fit.losses.append(epoch(e))
        if validate is None:
            bar.set_postfix(loss=f"{fit.losses[-1]:.4f}")
            continue
        loss = validate()
        fit.val_losses.append(loss)
        bar.set_postfix(loss=f"{fit.losses[-1]:.4f}", val=f"{loss:.4f}")
        better_than = best - MIN_IMPROVEMENT * abs(best) if math.isfinite(best) else best
        if loss < better_than:
            best, fit.best_epoch = loss, e + 1
            kept = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        elif e + 1 - (fit.best_epoch or 0) >= patience:
            fit.stopped_early = e + 1 < epochs
            break
    bar.close()
    if kept is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in kept:
                    p.copy_(kept[name])
    return fit


@torch.no_grad()
def cached_loss(model: HeadedModel, features: CachedFeatures) -> float:
    """The model's total loss over cached features (heads in eval mode), as ``forward``
    combines the heads' losses."""
    preds = predict_on_features(model, features)
    labels = features.labels
    losses = {}
    for name, cfg in model.head_configs.items():
        if cfg.loss_fct is None or cfg.target not in labels:
            continue
        p, y = preds[name], labels[cfg.target]
        if not cfg.pred_for_sequence:  # (tokens, n): one sequence of every stored token
            p, y = p[None], y[None]
        losses[name] = head_loss(cfg, p.to(model.device), y.to(model.device), None)
    total, _ = model.combine_losses(losses)
    return float(total) if total is not None else math.nan


def _full_epochs(
    model: HeadedModel,
    tokenizer: Any,
    train_set: list[dict],
    val_set: list[dict],
    training: dict[str, Any],
    opt: torch.optim.Optimizer,
    collator: Any = None,
) -> tuple[Callable[[int], float], Callable[[], float] | None]:
    """(one epoch, the validation loss) through the whole model (the backbone trains unless
    frozen)."""
    from torch.utils.data import DataLoader

    torch.manual_seed(training["seed"])
    collate = collator or HeadedCollator(model, tokenizer)
    g = torch.Generator().manual_seed(training["seed"])
    size = training["batch_size"]
    loader = DataLoader(train_set, batch_size=size, shuffle=True, generator=g, collate_fn=collate)

    def epoch(e: int) -> float:
        model.train()
        total, n = 0.0, 0
        for batch in loader:
            out = model(**batch_to_device(batch, model.device))
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            opt.step()
            total, n = total + float(out.loss.detach()), n + 1
        return total / max(n, 1)

    @torch.no_grad()
    def validate() -> float:
        model.eval()
        total = 0.0
        for start in range(0, len(val_set), size):
            chunk = val_set[start : start + size]
            total += float(model(**batch_to_device(collate(chunk), model.device)).loss) * len(chunk)
        return total / len(val_set)

    return epoch, (validate if val_set else None)
