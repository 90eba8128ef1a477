"""Sequence pooling: reduce token states (batch, seq, hidden) to one vector per sequence.

Every strategy reads padding from the attention mask (never from pad ids), so right
padding, left padding, pad == eos and one-token sequences all work; none writes into the
hidden states it is given. Strategies are registered by name (``POOLINGS``) and can be
concatenated with "+" ("mean+max"); aliases: "cls" → "first".
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .errors import ConfigError
from .registry import Registry

POOLINGS: Registry = Registry("pooling strategy", "pooling")
ALIASES = {"cls": "first"}


def parse_pooling(spec: str, head: str | None = None) -> list[str]:
    """Split "mean+max" into canonical strategy names, validating each."""
    where = f"HeadConfig(name={head!r}): " if head else ""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(
            f"{where}pooling={spec!r} is invalid; allowed: {', '.join(POOLINGS.names())}"
        )
    names = []
    for part in spec.split("+"):
        key = ALIASES.get(part.strip().lower(), part.strip().lower())
        if key not in POOLINGS:
            raise ConfigError(
                f"{where}pooling={spec!r}: {part.strip()!r} is not a known pooling strategy; "
                f"allowed: {', '.join(POOLINGS.names() + sorted(ALIASES))}, joined with '+'"
            )
        names.append(key)
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}pooling={spec!r} repeats a strategy")
    return names


def _float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.to(like.dtype).unsqueeze(-1)  # (batch, seq, 1)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last non-padding position per row, for either padding side. (batch,)"""
    positions = torch.arange(mask.shape[1], device=mask.device)
    return (positions * mask.long()).argmax(-1)


def first_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the first non-padding position per row (0 for an all-padding row). (batch,)"""
    return mask.long().argmax(-1)


def _gather(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), index]


class PoolingStrategy(nn.Module):
    """One way to pool. ``forward(hidden, mask, pooler)`` → (batch, out_size)."""

    needs_pooler = False

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size

    @property
    def out_size(self) -> int:
        return self.hidden_size

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}"


@POOLINGS.register("last")
class LastToken(PoolingStrategy):
    """The last non-padding token (GPT-style classifiers)."""

    def forward(self, hidden, mask, pooler=None):
        return _gather(hidden, last_token_index(mask))


@POOLINGS.register("first")
class FirstToken(PoolingStrategy):
    """The first non-padding token ([CLS] for BERT-style encoders)."""

    def forward(self, hidden, mask, pooler=None):
        return _gather(hidden, first_token_index(mask))


@POOLINGS.register("pooler")
class BackbonePooler(PoolingStrategy):
    """The backbone's own pooler (BERT: dense + tanh over [CLS]) applied to the hooked layer."""

    needs_pooler = True

    def forward(self, hidden, mask, pooler=None):
        if pooler is None:
            raise ConfigError("pooling='pooler' needs a backbone with a pooler module")
        first = _gather(hidden, first_token_index(mask)).unsqueeze(1)  # (batch, 1, hidden)
        out = pooler(first.to(next(pooler.parameters()).dtype))
        return out[0] if isinstance(out, tuple) else out


@POOLINGS.register("mean")
class MeanPooling(PoolingStrategy):
    """Mean over non-padding tokens (sentence-transformers' default)."""

    def forward(self, hidden, mask, pooler=None):
        m = _float_mask(mask, hidden)
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1)


@POOLINGS.register("mean_sqrt_len")
class MeanSqrtLenPooling(PoolingStrategy):
    """Sum over non-padding tokens divided by sqrt(length)."""

    def forward(self, hidden, mask, pooler=None):
        m = _float_mask(mask, hidden)
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1).sqrt()


@POOLINGS.register("max")
class MaxPooling(PoolingStrategy):
    """Element-wise max over non-padding tokens; padding never wins (0 for an empty row)."""

    def forward(self, hidden, mask, pooler=None):
        keep = mask.bool().unsqueeze(-1)
        filled = torch.where(keep, hidden, torch.finfo(hidden.dtype).min)
        out = filled.max(1).values
        return torch.where(keep.any(1), out, torch.zeros_like(out))


@POOLINGS.register("weighted_mean")
class WeightedMeanPooling(PoolingStrategy):
    """Position-weighted mean (weights 1..n over real tokens), as in SGPT for decoder models."""

    def forward(self, hidden, mask, pooler=None):
        m = mask.to(hidden.dtype)
        weights = (m.cumsum(-1) * m).unsqueeze(-1)  # (batch, seq, 1): 1..n on real tokens
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)


@POOLINGS.register("attention")
class AttentionPooling(PoolingStrategy):
    """Learned attention pooling: softmax(w·h + b) over non-padding tokens, weighted sum."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__(hidden_size)
        self.score = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.score.weight, std=1.0 / math.sqrt(hidden_size))
        nn.init.zeros_(self.score.bias)

    def forward(self, hidden, mask, pooler=None):
        h = hidden.to(self.score.weight.dtype)
        scores = self.score(h).squeeze(-1)  # (batch, seq)
        scores = scores.masked_fill(~mask.bool(), torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores, dim=-1) * mask.to(scores.dtype)
        return (h * weights.unsqueeze(-1)).sum(1)


class SequencePooling(nn.Module):
    """Concatenation of one or more strategies; ``out_size`` is the sum of their widths."""

    def __init__(self, strategies: list[str], hidden_size: int, pooler_size: int | None = None):
        super().__init__()
        self.names = list(strategies)
        self.strategies = nn.ModuleDict({n: POOLINGS.get(n)(hidden_size) for n in self.names})
        self.hidden_size = hidden_size
        self.pooler_size = pooler_size

    @property
    def out_size(self) -> int:
        return sum(
            (self.pooler_size or self.hidden_size) if s.needs_pooler else s.out_size
            for s in self.strategies.values()
        )

    @property
    def needs_pooler(self) -> bool:
        return any(s.needs_pooler for s in self.strategies.values())

    def forward(
        self, hidden: torch.Tensor, mask: torch.Tensor | None, pooler: nn.Module | None = None
    ) -> torch.Tensor:
        """(batch, seq, hidden), (batch, seq) → (batch, out_size). No mask: all tokens count."""
        if mask is None:
            mask = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
        mask = mask.to(hidden.device)
        parts = [s(hidden, mask, pooler) for s in self.strategies.values()]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def extra_repr(self) -> str:
        return f"strategies={'+'.join(self.names)}, out_size={self.out_size}"
