"""Multi-task loss weighting: how per-head losses combine into one training loss.

``fixed``: loss_weight × loss. ``adaptive``: each loss normalised by its running mean and
std once ``warmup`` steps have been seen (zero during warm-up).
``uncertainty``: learned homoscedastic uncertainty (Kendall et al. 2018):
exp(-s) × loss + s with one learned log-variance s per head, times loss_weight.

Schemes are registered by name (``WEIGHTINGS``, like ``LOSSES`` and ``HEADS``): a scheme's
``name`` is the one it is registered under, and checkpoints record it with ``config()``, so a
user's ``@WEIGHTINGS.register("mine")`` subclass of ``LossWeighting`` saves and loads back.
It is built as ``cls(weights, **options)`` with ``weights`` the heads' ``loss_weight`` values
and ``options`` what its ``config()`` returned besides the name.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from ..registry import Registry

WEIGHTINGS: Registry = Registry("loss weighting", "loss_weighting")


@WEIGHTINGS.register("fixed")
class LossWeighting(nn.Module):
    """Maps {head: loss} to {head: adapted loss}; the total is the sum of adapted losses."""

    def __init__(self, weights: dict[str, float]) -> None:
        super().__init__()
        self.weights = dict(weights)

    def forward(self, losses: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # a weight of 1 is the loss itself (bit for bit): no operation for it
        return {k: v if self.weights[k] == 1 else v * self.weights[k] for k, v in losses.items()}

    @property
    def name(self) -> str | None:
        """The name this scheme's class is registered under (None: unregistered)."""
        return WEIGHTINGS.name_of(type(self))

    def config(self) -> dict:
        """``{"name": ..., **options}``: what a checkpoint records to build it again."""
        return {"name": self.name}


@WEIGHTINGS.register("adaptive")
class AdaptiveWeighting(LossWeighting):
    """Normalise each head's loss by its running mean/std after a warm-up: over every loss
    seen (Welford, sample std) or, with ``momentum``, exponentially weighted."""

    def __init__(self, weights: dict[str, float], warmup: int = 5, momentum: float | None = None):
        super().__init__(weights)
        if not isinstance(warmup, int) or warmup < 1:
            raise ConfigError(f"adaptive weighting: warmup={warmup!r} is invalid; an integer >= 1")
        if momentum is not None and (
            isinstance(momentum, bool)
            or not isinstance(momentum, (int, float))
            or not 0 < momentum <= 1
        ):
            raise ConfigError(
                f"adaptive weighting: momentum={momentum!r} is invalid; a number in (0, 1] or None"
            )
        self.warmup = warmup
        self.momentum = None if momentum is None else float(momentum)
        n = len(weights)
        self.names = list(weights)
        self.register_buffer("count", torch.zeros(n, dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(n, dtype=torch.float64))
        self.register_buffer("m2", torch.zeros(n, dtype=torch.float64))

    def forward(self, losses):
        out = {}
        for k, v in losses.items():
            i = self.names.index(k)
            if self.count[i] < self.warmup:
                out[k] = v * 0.0
            else:
                var = (
                    self.m2[i]
                    if self.momentum is not None
                    else self.m2[i] / (self.count[i] - 1).clamp(min=1)
                )
                std = var.sqrt().clamp(min=1e-6)
                out[k] = self.weights[k] * (v - self.mean[i].to(v.dtype)) / std.to(v.dtype)
            if self.training and torch.isfinite(v).all():
                x = v.detach().double()
                self.count[i] += 1
                delta = x - self.mean[i]
                if self.momentum is None:  # Welford: m2 is the sum of squared deviations
                    self.mean[i] += delta / self.count[i]
                    self.m2[i] += delta * (x - self.mean[i])
                elif self.count[i] == 1:
                    self.mean[i] = x
                else:  # exponentially weighted mean and variance (m2 holds the variance)
                    self.mean[i] += self.momentum * delta
                    self.m2[i] = (1 - self.momentum) * (self.m2[i] + self.momentum * delta * delta)
        return out

    def config(self) -> dict:
        cfg = {"name": self.name, "warmup": self.warmup}
        if self.momentum is not None:
            cfg["momentum"] = self.momentum
        return cfg


@WEIGHTINGS.register("uncertainty")
class UncertaintyWeighting(LossWeighting):
    """exp(-s_k) × L_k + s_k per head, with learned log-variances s_k (one per head)."""

    def __init__(self, weights: dict[str, float]) -> None:
        super().__init__(weights)
        self.log_vars = nn.ParameterDict({k: nn.Parameter(torch.zeros(())) for k in weights})

    def forward(self, losses):
        out = {}
        for k, v in losses.items():
            s = self.log_vars[k].to(v.dtype)
            out[k] = self.weights[k] * (torch.exp(-s) * v + s)
        return out


def build_weighting(name: str, weights: dict[str, float], **kwargs) -> LossWeighting:
    """Build the scheme registered as ``name`` ("fixed", "adaptive", "uncertainty", ...)."""
    return WEIGHTINGS.get(name)(weights, **kwargs)


def savable_config(weighting: LossWeighting) -> dict:
    """``weighting.config()``, checked to name the class a checkpoint will build again."""
    cfg = weighting.config()
    name = cfg.get("name") if isinstance(cfg, dict) else None
    if name in WEIGHTINGS and WEIGHTINGS.get(name) is type(weighting):
        return cfg
    cls, registered = type(weighting).__name__, WEIGHTINGS.name_of(type(weighting))
    if registered is None:
        raise ConfigError(
            f"loss_weighting={cls} is not registered in WEIGHTINGS, so a checkpoint could not "
            f"build it again; register it (@WEIGHTINGS.register('my_scheme') on the class)"
        )
    raise ConfigError(
        f"loss_weighting={cls}: its config() names {name!r}, but {cls} is registered as "
        f"{registered!r}; let config() return {{'name': self.name, **options}}"
    )
