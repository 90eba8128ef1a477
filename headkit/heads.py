"""MLPHead: (optional pooling) → Linear [→ activation → Linear]* → output activation."""

from __future__ import annotations

import torch
from torch import nn

from .activations import build_activation
from .config import HeadConfig
from .errors import ConfigError
from .pooling import SequencePooling


class MLPHead(nn.Module):
    """A head built from a resolved HeadConfig (``in_size`` and ``num_outputs`` set).

    ``num_layers=1`` is one Linear(in, out); ``num_layers=n`` is n Linears with
    ``hidden_activation`` between them and nothing after the last; ``output_activation``
    follows the last Linear. Sequence heads pool first (``pooling``); the pooled width may
    exceed ``in_size`` when strategies are concatenated ("mean+max" → 2 × in_size).
    """

    def __init__(self, config: HeadConfig, pooler_size: int | None = None) -> None:
        super().__init__()
        if config.in_size is None or config.num_outputs is None:
            raise ConfigError(
                f"MLPHead({config.name!r}) needs a resolved config: in_size={config.in_size}, "
                f"num_outputs={config.num_outputs} (HeadedModel fills them from the backbone)"
            )
        self.config = config
        self.name = config.name
        self.pooling: SequencePooling | None = None
        width = config.in_size
        if config.pred_for_sequence:
            strategies = config.pooling_strategies or ["first"]
            self.pooling = SequencePooling(strategies, config.in_size, pooler_size)
            width = self.pooling.out_size
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

    def features(
        self,
        hidden: torch.Tensor,
        mask: torch.Tensor | None = None,
        pooler: nn.Module | None = None,
    ) -> torch.Tensor:
        """The head's input: pooled (batch, width) or per-token (batch, seq, in_size)."""
        if self.config.block_gradients:
            hidden = hidden.detach()
        if self.pooling is not None:
            hidden = self.pooling(hidden, mask, pooler)
        return hidden.to(self.linears[0].weight.dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        mask: torch.Tensor | None = None,
        pooler: nn.Module | None = None,
    ) -> torch.Tensor:
        """hidden (batch, seq, in_size) → (batch, num_outputs) or (batch, seq, num_outputs)."""
        if hidden.shape[-1] != self.config.in_size:
            raise ConfigError(
                f"head {self.name!r}: hooked states have width {hidden.shape[-1]} but "
                f"in_size={self.config.in_size}"
            )
        return self.from_features(self.features(hidden, mask, pooler))

    def from_features(self, features: torch.Tensor) -> torch.Tensor:
        """Apply the MLP and output activation to precomputed ``features``."""
        return self.output_activation(self.mlp(features.to(self.linears[0].weight.dtype)))

    def extra_repr(self) -> str:
        c = self.config
        kind = "causal_lm" if c.is_causal_lm else ("sequence" if c.pred_for_sequence else "token")
        return (
            f"name={c.name!r}, layer_hook={c.layer_hook}, kind={kind}, in_size={c.in_size}, "
            f"hidden_size={c.hidden_size}, num_layers={c.num_layers}, num_outputs={c.num_outputs}"
        )
