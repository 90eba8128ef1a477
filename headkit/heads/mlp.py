"""``MLPHead``, the default head kind ("mlp"): Linear layers with activations between them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..modules import first_parameter, has_hooks
from .activations import build_activation
from .base import HEADS, Head

if TYPE_CHECKING:
    from ..config import HeadConfig


@HEADS.register("mlp")
class MLPHead(Head):
    """(optional pooling) → Linear [→ activation → Linear]* → output activation.

    ``num_layers=1`` is one Linear(in, out); ``num_layers=n`` is n Linears with
    ``hidden_activation`` between them and nothing after the last; ``output_activation``
    follows the last Linear. Sequence heads pool first (``pooling``); the pooled width may
    exceed ``in_size`` when strategies are concatenated ("mean+max" → 2 × in_size).
    """

    def __init__(
        self,
        config: HeadConfig,
        pooler_size: int | None = None,
        pooler: nn.Module | None = None,
        special_tokens: int | None = None,
    ) -> None:
        super().__init__(config, pooler_size, pooler, special_tokens)
        width = self.in_features
        layers: list[nn.Module] = []
        for i in range(config.num_layers):
            last = i == config.num_layers - 1
            out = config.num_outputs if last else config.hidden_size
            if config.dropout > 0:
                layers.append(nn.Dropout(config.dropout))
            layers.append(nn.Linear(width, out, bias=config.output_bias if last else True))
            if not last:
                layers.append(build_activation(config.hidden_activation))
            width = out
        self.mlp = nn.Sequential(*layers)
        self.output_activation = build_activation(config.output_activation)
        self.requires_grad_(config.trainable)

    @property
    def linears(self) -> list[nn.Linear]:
        """The head's Linear layers, in order."""
        return [m for m in self.mlp if isinstance(m, nn.Linear)]

    def features(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The head's input in the head's dtype: pooled (batch, width) or (batch, seq, in)."""
        return super().features(hidden, mask).to(self._dtype)

    def from_features(self, features: torch.Tensor) -> torch.Tensor:
        """Apply the MLP and output activation to precomputed ``features``."""
        out = self.mlp(features.to(self._dtype))
        if isinstance(self.output_activation, nn.Identity):  # "linear": once per head a step
            return out
        return self.output_activation(out)

    @property
    def _dtype(self) -> torch.dtype:
        """The first Linear's dtype (its weight is the MLP's first parameter)."""
        return first_parameter(self.mlp).dtype  # type: ignore[union-attr]

    # ------------------------------------------------------------------ hooks (see base.py)
    def output_projection(self) -> nn.Linear:
        """The last Linear."""
        return self.linears[-1]

    def linear_form(self) -> tuple[nn.Linear, nn.Module | None] | None:
        """The Linear and output activation of a one-layer head without dropout."""
        mods = self._modules  # read directly: asked per head every forward (heads/stacked.py)
        mlp, act = mods["mlp"], mods["output_activation"]
        layers = mlp._modules
        if len(layers) != 1 or has_hooks(mlp):
            return None
        (linear,) = layers.values()
        return linear, (None if isinstance(act, nn.Identity) else act)

    def dense_layers(self) -> list[tuple[nn.Linear, str]]:
        """Each Linear with ``hidden_activation`` after it, the last with ``output_activation``
        (dropout is left out, as at inference)."""
        c = self.config
        linears = self.linears
        acts = [c.hidden_activation] * (len(linears) - 1) + [c.output_activation]
        return list(zip(linears, acts))

    @classmethod
    def parameter_count(cls, config: HeadConfig, pooler_size: int | None = None) -> int:
        w, n = cls.pooled_width(config, pooler_size), config.num_layers
        h, o = config.hidden_size, config.num_outputs
        last = o if config.output_bias else 0  # the last Linear's bias
        if n == 1:
            linears = w * o + last
        else:  # w → h, (n - 2) × h → h, h → o; every Linear but the last has a bias
            linears = (w + 1) * h + (n - 2) * (h + 1) * h + h * o + last
        return cls.pooling_parameter_count(config) + linears

    @classmethod
    def tensor_count(cls, config: HeadConfig) -> int:
        """One weight per Linear."""
        return config.num_layers

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"name={c.name!r}, layer_hook={c.layer_hook}, kind={c.layout}, in_size={c.in_size}, "
            f"hidden_size={c.hidden_size}, num_layers={c.num_layers}, num_outputs={c.num_outputs}"
        )
