"""Sequence pooling: reduce token states (batch, seq, hidden) to one vector per sequence.

Every strategy reads padding from the attention mask (never from pad ids), so right
padding, left padding, pad == eos and one-token sequences all work. None writes into the
hidden states it is given, and padded positions are selected away with ``torch.where``
rather than multiplied by 0, so NaN or inf at padded positions cannot leak into a result.
Averages (mean, mean_sqrt_len, weighted_mean) accumulate in float32 or wider and never
overflow where the exact answer is finite; for half-precision states they return float32
(a concatenation with selections is promoted to it). Strategies are registered by name
(``POOLINGS``) and can be concatenated with "+" ("mean+max"); aliases: "cls" → "first".
See docs/pooling.md for which one to use.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from ..errors import BatchError, ConfigError
from ..modules import first_parameter
from ..registry import Registry

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


def _keep(mask: torch.Tensor) -> torch.Tensor:
    return mask.bool().unsqueeze(-1)  # (batch, seq, 1)


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """Average half-precision states in float32 (a sum of 64 fp16 states may overflow, and so
    may a mean_sqrt_len result): averaging strategies return float32 for half inputs."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _masked_weighted_mean(
    hidden: torch.Tensor, weights: torch.Tensor, norm: torch.Tensor
) -> torch.Tensor:
    """sum_t weights[b, t] * hidden[b, t] / norm[b] over positions with weight != 0, in float32
    or wider. (batch, hidden)

    No intermediate overflows while the result is finite: each (row, dim) is scaled by a power
    of two at least its largest |value| before summing and scaled back after dividing. Powers of
    two commute with rounding, so the result is bit-identical to the plain sum when that one
    does not overflow. On the CPU, where a value can be read for free, the plain sum is taken
    when a bound shows it cannot overflow.
    """
    acc = _accumulator(hidden.dtype)
    w = weights.to(acc).unsqueeze(-1)  # (batch, seq, 1)
    h = torch.where(w != 0, hidden.to(acc), torch.zeros((), dtype=acc, device=hidden.device))
    top = h.abs().amax(1)  # (batch, hidden)
    if h.device.type == "cpu" and not torch.compiler.is_compiling():
        # Reading is free on the CPU: when no partial sum can overflow, the plain sum is the
        # same result (bit for bit) at a quarter of the cost.
        bound = top.amax() * w.abs().sum(1).amax()
        if bool(bound < torch.finfo(acc).max / 2):
            return (h * w).sum(1) / norm.to(acc)
    exp = torch.frexp(top).exponent  # top < 2**exp
    exp = torch.where(torch.isfinite(top), exp, 0).clamp(min=0)  # only ever scale down
    total = (torch.ldexp(h, -exp.unsqueeze(1)) * w).sum(1) / norm.to(acc)
    half = exp // 2  # two steps: 2**exp alone may not be representable (2**128 in float32)
    return torch.ldexp(torch.ldexp(total, exp - half), half)


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
    """One way to pool. ``forward(hidden, mask)`` → (batch, out_size).

    Register a new one with ``@POOLINGS.register("name")`` on a subclass; it is built as
    ``cls(hidden_size)`` and gets a boolean-castable mask of shape (batch, seq). A strategy
    that reads the backbone's pooler sets ``needs_pooler = True`` and is built as
    ``cls(hidden_size, pooler, pooler_size)`` instead; one that skips the leading special
    tokens of a vision backbone sets ``needs_special_tokens = True`` and is built as
    ``cls(hidden_size, special_tokens)``. ``width`` says how wide its output is
    (``out_size`` of a built one), so a head's size is known before anything is built.
    """

    needs_pooler = False
    #: A strategy that skips the backbone's leading special tokens (CLS, registers) sets this;
    #: it is built as ``cls(hidden_size, special_tokens)`` instead.
    needs_special_tokens = False

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size

    @classmethod
    def width(cls, hidden_size: int, pooler_size: int | None = None) -> int:
        """Output width on ``hidden_size``-wide states (``pooler_size``: the backbone pooler's)."""
        return hidden_size

    @classmethod
    def parameter_count(cls, hidden_size: int) -> int:
        """Parameters the strategy learns on ``hidden_size``-wide states (0: none)."""
        return 0

    @property
    def out_size(self) -> int:
        return self.width(self.hidden_size)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}"


@POOLINGS.register("last")
class LastToken(PoolingStrategy):
    """The last non-padding token: under causal attention the only one that saw everything."""

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return _gather(hidden, last_token_index(mask))


@POOLINGS.register("first")
class FirstToken(PoolingStrategy):
    """The first non-padding token ([CLS] for BERT-style encoders)."""

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return _gather(hidden, first_token_index(mask))


def pools_every_position(pooler: nn.Module) -> bool:
    """Whether a backbone's pooler reads every position (SigLIP's attention-pooling "MAP"
    head, a class named ``...PoolingHead``: a learned query attending to every patch) rather
    than the first token only (BERT's and ViT's dense + tanh)."""
    return type(pooler).__name__.endswith("PoolingHead")


@POOLINGS.register("pooler")
class BackbonePooler(PoolingStrategy):
    """The backbone's own pooler applied to the hooked layer: BERT's and ViT's dense + tanh
    over the first token, SigLIP's attention pooling over every patch (its ``pooler_output``).

    A first-token pooler gets the first real token of each row, whatever the padding side; one
    that reads every position (``pools_every_position``) gets the whole sequence with each row
    rotated so that its first real token comes first, as in the model's own forward (images
    have no padding). The pooler is bound here, where it is used, without becoming a
    submodule: it belongs to the backbone, so it is neither saved with the head nor moved by it.
    """

    needs_pooler = True

    def __init__(
        self, hidden_size: int, pooler: nn.Module | None = None, pooler_size: int | None = None
    ) -> None:
        super().__init__(hidden_size)
        self._bound = (pooler,)  # a tuple: nn.Module does not register it as a submodule
        self.pooler_size = pooler_size
        self.every_position = pooler is not None and pools_every_position(pooler)

    @property
    def pooler(self) -> nn.Module | None:
        """The backbone's pooler bound at construction (None when there is none)."""
        return self._bound[0]

    @classmethod
    def width(cls, hidden_size: int, pooler_size: int | None = None) -> int:
        return pooler_size or hidden_size

    @property
    def out_size(self) -> int:
        return self.width(self.hidden_size, self.pooler_size)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pooler = self.pooler
        if pooler is None:
            raise ConfigError(
                "pooling='pooler' needs a backbone with a pooler module (BERT-style); "
                "this one has none: use 'first', 'mean', ...",
                field="pooling",
                value=None,
            )
        if self.every_position:
            seq = hidden.shape[1]
            start = first_token_index(mask).unsqueeze(1)  # (batch, 1)
            index = (torch.arange(seq, device=hidden.device) + start) % seq  # (batch, seq)
            states = hidden.gather(1, index.unsqueeze(-1).expand_as(hidden))
        else:
            states = _gather(hidden, first_token_index(mask)).unsqueeze(1)  # (batch, 1, hidden)
        param = next(pooler.parameters(), None)
        out = pooler(states if param is None else states.to(param.dtype))
        return out[0] if isinstance(out, tuple) else out


def _real_count(mask: torch.Tensor) -> torch.Tensor:
    """Real tokens per row (batch, 1), at least 1 (an all-padding row pools to 0)."""
    return mask.bool().sum(1, keepdim=True).clamp(min=1)


@POOLINGS.register("mean")
class MeanPooling(PoolingStrategy):
    """Mean over non-padding tokens (sentence-transformers' default); float32 for half inputs."""

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return _masked_weighted_mean(hidden, mask.bool(), _real_count(mask))


@POOLINGS.register("patch_mean")
class PatchMeanPooling(PoolingStrategy):
    """Mean over a vision backbone's patch tokens: the leading special tokens (CLS, DINOv2's
    registers, DeiT's distillation token; ``special_tokens`` of them, read from the backbone)
    are left out. ``"first+patch_mean"`` on DINOv2's ``last_hidden_state`` is what
    ``Dinov2ForImageClassification`` classifies; ``"patch_mean"`` on CLIP's last layer what
    ``CLIPForImageClassification`` does. float32 for half inputs."""

    needs_special_tokens = True

    def __init__(self, hidden_size: int, special_tokens: int | None = None) -> None:
        super().__init__(hidden_size)
        self.special_tokens = special_tokens

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        skip = self.special_tokens
        if skip is None:
            raise ConfigError(
                "pooling='patch_mean' needs the number of the backbone's leading special "
                "tokens; build the head through HeadedModel (it reads them from the backbone)"
            )
        if hidden.shape[1] <= skip:
            raise BatchError(
                f"pooling='patch_mean': the hooked states have {hidden.shape[1]} positions, "
                f"no more than the backbone's {skip} special tokens, so there is no patch"
            )
        keep = mask[:, skip:].bool()  # (batch, patches)
        return _masked_weighted_mean(hidden[:, skip:], keep, _real_count(keep))

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, special_tokens={self.special_tokens}"


@POOLINGS.register("mean_sqrt_len")
class MeanSqrtLenPooling(PoolingStrategy):
    """Sum over non-padding tokens divided by sqrt(length) (sentence-transformers' name);
    float32 for half inputs (the result may exceed the half range: 4,096 tokens of 2,000)."""

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        count = _real_count(mask).to(_accumulator(hidden.dtype))
        return _masked_weighted_mean(hidden, mask.bool(), count.sqrt())


@POOLINGS.register("max")
class MaxPooling(PoolingStrategy):
    """Element-wise max over non-padding tokens; padding never wins (0 for an empty row).

    A dimension whose real tokens are all -inf gives -inf, whether or not the row has padding.
    """

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        keep = _keep(mask)
        # -inf, not finfo.min: a dimension whose real tokens are all -inf is -inf, padded or not
        lowest = torch.full((), -math.inf, dtype=hidden.dtype, device=hidden.device)
        out = torch.where(keep, hidden, lowest).max(1).values
        return torch.where(keep.any(1), out, torch.zeros_like(out))


@POOLINGS.register("weighted_mean")
class WeightedMeanPooling(PoolingStrategy):
    """Position-weighted mean, weights 1..n over the real tokens (SGPT, for decoders).

    Weights count real tokens only, so left and right padding give the same result (as
    sentence-transformers' "weightedmean" does since it starts at the first real token).
    float32 for half inputs.
    """

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.long()
        weights = m.cumsum(-1) * m  # (batch, seq): 1..n on real tokens, 0 on padding
        norm = weights.sum(1, keepdim=True).clamp(min=1)
        return _masked_weighted_mean(hidden, weights, norm)


@POOLINGS.register("attention")
class AttentionPooling(PoolingStrategy):
    """Learned attention pooling: softmax(w·h + b) over non-padding tokens, weighted sum.

    ``w`` and ``b`` are head parameters: trained with the head, saved with its checkpoint.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__(hidden_size)
        self.score = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.score.weight, std=1.0 / math.sqrt(hidden_size))
        nn.init.zeros_(self.score.bias)

    @classmethod
    def parameter_count(cls, hidden_size: int) -> int:
        return hidden_size + 1  # score: Linear(hidden_size, 1)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        keep = mask.bool()
        h = hidden.to(self.score.weight.dtype)
        h = torch.where(keep.unsqueeze(-1), h, torch.zeros((), dtype=h.dtype, device=h.device))
        scores = self.score(h).squeeze(-1)  # (batch, seq)
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores, dim=-1) * keep.to(scores.dtype)  # 0 for empty rows
        return (h * weights.unsqueeze(-1)).sum(1)


class SequencePooling(nn.Module):
    """Concatenation of one or more strategies; ``out_size`` is the sum of their widths.

    ``pooler`` is the backbone's pooler module and ``pooler_size`` its output width: only the
    strategies that read it (``needs_pooler``, the "pooler" strategy) receive them.
    ``special_tokens`` is how many leading positions of a vision backbone are no patch (CLS,
    registers): only ``needs_special_tokens`` strategies ("patch_mean") receive it.
    """

    def __init__(
        self,
        strategies: list[str],
        hidden_size: int,
        pooler_size: int | None = None,
        pooler: nn.Module | None = None,
        special_tokens: int | None = None,
    ) -> None:
        super().__init__()
        self.names = list(strategies)
        self.strategies = nn.ModuleDict(
            {
                n: _build_strategy(n, hidden_size, pooler, pooler_size, special_tokens)
                for n in self.names
            }
        )
        self.hidden_size = hidden_size
        # read once per head a step (``Head.pooling_key``); the strategies are fixed here
        self._has_parameters = first_parameter(self.strategies) is not None

    @property
    def pooler(self) -> nn.Module | None:
        """The backbone's pooler bound at construction (None when no strategy reads one)."""
        bound = [getattr(s, "pooler", None) for s in self.strategies.values() if s.needs_pooler]
        return next((p for p in bound if p is not None), None)

    @property
    def widths(self) -> dict[str, int]:
        """Width of each strategy's slice of the output, in order of concatenation."""
        return {n: s.out_size for n, s in self.strategies.items()}

    @property
    def out_size(self) -> int:
        return sum(self.widths.values())

    @property
    def needs_pooler(self) -> bool:
        return any(s.needs_pooler for s in self.strategies.values())

    @property
    def has_parameters(self) -> bool:
        """Whether any strategy learns (then its output cannot be shared between heads)."""
        return self._has_parameters

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """(batch, seq, hidden), (batch, seq) → (batch, out_size). No mask: all tokens count."""
        if hidden.dim() != 3:
            raise BatchError(
                f"pooling needs hidden states of shape (batch, seq, hidden), got "
                f"{tuple(hidden.shape)}"
            )
        if mask is None:
            mask = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
        elif tuple(mask.shape) != tuple(hidden.shape[:2]):
            raise BatchError(
                f"attention_mask of shape {tuple(mask.shape)} does not match the hidden states "
                f"{tuple(hidden.shape[:2])} (batch, seq)"
            )
        mask = mask.to(hidden.device)
        parts = [s(hidden, mask) for s in self.strategies.values()]
        if len(parts) == 1:
            return parts[0]
        dtype = functools.reduce(torch.promote_types, [p.dtype for p in parts])
        return torch.cat([p.to(dtype) for p in parts], dim=-1)

    def split(self, pooled: torch.Tensor) -> dict[str, torch.Tensor]:
        """Cut a concatenated (batch, out_size) output back into one tensor per strategy."""
        return dict(zip(self.names, pooled.split(list(self.widths.values()), dim=-1)))

    def extra_repr(self) -> str:
        return f"strategies={'+'.join(self.names)}, out_size={self.out_size}"


def _build_strategy(
    name: str,
    hidden_size: int,
    pooler: nn.Module | None,
    pooler_size: int | None,
    special_tokens: int | None,
) -> PoolingStrategy:
    cls = POOLINGS.get(name)
    if cls.needs_pooler:
        return cls(hidden_size, pooler, pooler_size)
    if getattr(cls, "needs_special_tokens", False):
        return cls(hidden_size, special_tokens)
    return cls(hidden_size)


def needs_special_tokens(strategies: list[str]) -> bool:
    """Whether any of ``strategies`` skips a vision backbone's leading special tokens."""
    return any(getattr(POOLINGS.get(n), "needs_special_tokens", False) for n in strategies)


def pooled_width(strategies: list[str], hidden_size: int, pooler_size: int | None = None) -> int:
    """``SequencePooling(strategies, hidden_size, pooler_size).out_size``, without building it."""
    return sum(POOLINGS.get(n).width(hidden_size, pooler_size) for n in strategies)


def pooling_parameter_count(strategies: list[str], hidden_size: int) -> int:
    """Parameters ``SequencePooling(strategies, hidden_size)`` learns, without building it."""
    return sum(POOLINGS.get(n).parameter_count(hidden_size) for n in strategies)
