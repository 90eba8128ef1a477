"""Preference pairs for a layer sweep: which layer carries the reward?

A pairwise probe is a linear reward ``r(x) = w · f(x)`` on one layer's pooled features,
fitted with the Bradley–Terry loss on pairs: ``-log sigmoid(r(chosen) - r(rejected))``, i.e.
logistic regression on the feature differences ``f(chosen) - f(rejected)`` without a bias.
It reuses the batched fitting of ``fit.py``: each pair is two rows, its difference labelled
1 and the negated difference labelled 0. Mirrored that way the fitted bias is 0 (the
gradient on it cancels pair by pair, and the standardisation's mean is 0), so the
classifier's logit difference is the reward difference. Splits are drawn by pair: a pair and
its mirror always fall on the same side.

The pairs are tokenised as headkit's reward training tokenises TRL's pairs
(``data/preferences.py``: a ``prompt`` prepended to both sides, conversations through the
chat template, pairs longer than ``max_length`` tokens on either side dropped, as TRL does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..data.preferences import TOKENIZED_PAIRS, is_conversation, tokenize_pair
from ..errors import ConfigError
from .data import ProbeRows

#: The fewest pairs a pairwise probe is fitted on (after dropping pairs too long).
MIN_PAIRS = 8

#: What a preference row holds (TRL's columns).
PAIR_COLUMNS = ("chosen", "rejected")


def is_pair_rows(inputs: Sequence[Any]) -> bool:
    """Whether ``inputs`` are preference rows: mappings with a ``chosen`` (or ``rejected``, or
    one of TRL's tokenised) column, as TRL writes them."""
    if not inputs or not isinstance(inputs[0], Mapping):
        return False
    names = {"chosen", "rejected", *(n for pair in TOKENIZED_PAIRS for n in pair)}
    return bool(names & set(inputs[0]))


def check_pairs(inputs: Sequence[Any]) -> None:
    """Refuse rows that are not preference pairs, sides that are empty, and too few pairs,
    naming the row, the column and what is allowed."""
    allowed = (
        "each row a mapping with 'chosen' and 'rejected' (texts or lists of {'role', "
        "'content'} messages; 'prompt' optional) or TRL's tokenised ids"
    )
    for i, row in enumerate(inputs):
        if not isinstance(row, Mapping):
            raise ConfigError(
                f"preference row {i} is a {type(row).__name__}; {allowed}",
                field="inputs",
                value=type(row).__name__,
            )
        if any(f"{a}" in row and f"{b}" in row for a, b, *_ in TOKENIZED_PAIRS):
            continue
        for column in PAIR_COLUMNS:
            if column not in row:
                raise ConfigError(
                    f"preference row {i} has no {column!r} column (keys: {sorted(row)}); {allowed}",
                    field=column,
                    value=None,
                )
            value = row[column]
            if _empty(value):
                raise ConfigError(
                    f"preference row {i}: {column}={value!r} is empty; {allowed}, non-empty",
                    field=column,
                    value=value,
                )
    if len(inputs) < MIN_PAIRS:
        raise ConfigError(
            f"got {len(inputs)} preference pairs; a pairwise probe needs at least {MIN_PAIRS} "
            "(held-out, validation and training pairs)",
            field="inputs",
            value=len(inputs),
        )


def _empty(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, float):
        return value != value  # NaN: an empty CSV cell read by pandas
    if isinstance(value, list):
        return not value or (is_conversation(value) and not any(m["content"] for m in value))
    return False


def pair_rows(tokenizer: Any, inputs: Sequence[Mapping[str, Any]], max_length: int) -> tuple:
    """(rows for the backbone pass: every kept pair's chosen side, then its rejected side;
    the input index of each kept pair; pairs dropped as longer than ``max_length``)."""
    kept, chosen, rejected = [], [], []
    for i, row in enumerate(inputs):
        ids = tokenize_pair(row, tokenizer)
        c, r = ids["chosen_ids"], ids["rejected_ids"]
        if len(c) > max_length or len(r) > max_length:
            continue  # TRL drops pairs too long, and so does headkit's reward training
        kept.append(i)
        chosen.append({"input_ids": c})
        rejected.append({"input_ids": r})
    if len(kept) < MIN_PAIRS:
        raise ConfigError(
            f"{len(kept)} of {len(inputs)} preference pairs fit in max_length={max_length} "
            f"tokens (longer pairs are dropped, as TRL does); a pairwise probe needs at least "
            f"{MIN_PAIRS}: raise max_length or give shorter pairs",
            field="max_length",
            value=max_length,
        )
    n = len(kept)
    rows = ProbeRows(
        examples=chosen + rejected,
        example=torch.arange(2 * n),
        position=None,
        y=torch.zeros(2 * n, dtype=torch.long),
        keys=[],
        classes=None,
    )
    return rows, kept, len(inputs) - n


def mirrored(features: dict, n_pairs: int) -> tuple[dict, ProbeRows]:
    """The difference problem: per key (2P, d) features → (2P, d) rows ``f(c) - f(r)`` then
    ``f(r) - f(c)``, with rows that split by pair (a pair and its mirror share an example)."""
    out = {}
    for key, x in features.items():
        diff = x[:n_pairs] - x[n_pairs:]  # (P, d)
        out[key] = torch.cat([diff, -diff])
    pairs = torch.arange(n_pairs)
    rows = ProbeRows(
        examples=[{}] * n_pairs,  # one "example" per pair: splits keep its two rows together
        example=torch.cat([pairs, pairs]),
        position=None,
        y=torch.cat([torch.ones(n_pairs), torch.zeros(n_pairs)]).long(),
        keys=[str(i) for i in range(n_pairs)] * 2,
        classes=[0, 1],
    )
    return out, rows


def reward_weight(weight: torch.Tensor) -> torch.Tensor:
    """The reward's weight (1, d) from the two-class probe's (2, d) Linear weight: the
    logit of "chosen wins" minus the other, i.e. the weight on ``f(chosen) - f(rejected)``."""
    return (weight[1] - weight[0])[None]


def pair_margins(diff: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``r(chosen) - r(rejected)`` of each pair: raw differences (n, d) by the reward weight
    (1, d), computed as ``nn.Linear`` would on each side, then subtracted."""
    return (diff @ weight[0].to(diff)).double()


__all__ = ["MIN_PAIRS", "check_pairs", "is_pair_rows", "mirrored", "pair_margins", "pair_rows"]
