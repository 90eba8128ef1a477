"""Reward data files for ``headkit train`` and ``headkit eval`` (docs/rewards.md, docs/cli.md).

A data file whose columns are TRL's preference pairs (``chosen`` / ``rejected``, or a reward
head's ``<target>_chosen`` / ``<target>_rejected``; ``prompt``, ``margin``, pre-tokenised ids)
trains and evaluates the model's ``bradley_terry`` heads; one with ``completions`` and
``labels`` (TRL's stepwise supervision) its PRM token head. They are read like any data file
(CSV, JSONL, Parquet, a saved dataset); in a CSV a conversation or a list is a JSON cell
(``[{"role": "user", "content": "..."}]``, ``["step 1", "step 2"]``). Tokenisation is TRL's
(``data/preferences.py``, ``data/stepwise.py``); pairs longer than ``training.max_length``
tokens are dropped as TRL drops them, and the count is reported.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any

from ..data.preferences import (
    PreferenceCollator,
    is_preference_data,
    pairwise_targets,
    tokenize_preferences,
)
from ..data.stepwise import STEP_SEPARATOR, is_stepwise_data, step_head, tokenize_stepwise
from ..errors import ConfigError

#: What ``headkit_cli.json`` records as ``format`` for reward data.
FORMATS = ("pairs", "steps")


def data_format(heads: Mapping[str, Any], columns: list[str]) -> str | None:
    """``"pairs"``, ``"steps"`` or None (a table of texts and labels) for a file with these
    columns, read by a model with these heads."""
    if pairwise_targets(heads) and is_preference_data(columns, heads):
        return "pairs"
    if is_stepwise_data(columns):
        return "steps"
    return None


def _cells(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """JSON cells of a text file (a conversation, a list of steps or labels) as values."""
    out = []
    for row in rows:
        parsed = {}
        for k, v in row.items():
            if isinstance(v, str) and v[:1] == "[":
                with contextlib.suppress(ValueError):  # text that only starts with "["
                    v = json.loads(v)
            parsed[k] = v
        out.append(parsed)
    return out


def encode_reward_rows(
    rows: list[dict[str, Any]],
    tokenizer: Any,
    heads: Mapping[str, Any],
    kind: str,
    max_length: int,
    step_separator: str = STEP_SEPARATOR,
) -> tuple[list[dict[str, Any]], int]:
    """(examples, rows dropped as too long) of a reward data file."""
    rows = _cells(rows)
    if kind == "pairs":
        examples = tokenize_preferences(rows, tokenizer, heads, max_length=max_length)
        return examples, len(rows) - len(examples)
    if kind != "steps":
        raise ConfigError(f"format={kind!r} is invalid; allowed: {', '.join(FORMATS)}")
    for row in rows:
        labels = row.get("labels")
        if isinstance(labels, list):  # "true"/"false" cells of a text file
            row["labels"] = [_step_label(v) for v in labels]
    target = heads[step_head(heads)].target
    examples = tokenize_stepwise(
        rows, tokenizer, target, step_separator=step_separator, max_length=max_length
    )
    return examples, 0


def _step_label(value: Any) -> int:
    if isinstance(value, bool) or value in (0, 1):
        return int(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return int(value.strip().lower() in ("true", "1"))
    raise ConfigError(f"a step label is {value!r}; allowed: true/false or 1/0")


def collator_for(model: Any, tokenizer: Any, kind: str | None) -> Any:
    """The collator of a reward format (None: the default ``HeadedCollator``)."""
    return PreferenceCollator(model, tokenizer) if kind == "pairs" else None
