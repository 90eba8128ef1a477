"""Preference data as TRL writes it, for reward heads (``loss_fct="bradley_terry"``).

A preference example holds a pair of texts: ``chosen`` / ``rejected``, plain strings or
conversations (lists of ``{"role", "content"}`` messages), with or without a ``prompt``
(prepended to both), an optional ``margin``, or already tokenised: ``chosen_ids`` /
``rejected_ids`` (TRL 1.x), ``chosen_input_ids`` / ``rejected_input_ids`` (its legacy names)
or ``input_ids_chosen`` / ``attention_mask_chosen`` / ``input_ids_rejected`` /
``attention_mask_rejected`` (TRL 0.x). Texts are tokenised as TRL's ``RewardTrainer`` does
(``trl/trainer/reward_trainer.py``): a plain text gets the tokenizer's eos appended unless it
ends with it and is tokenised with special tokens; a conversation goes through the
tokenizer's chat template (``tools`` and ``chat_template_kwargs`` columns passed on); pairs
longer than ``max_length`` tokens on either side are dropped, not truncated.

Several reward heads: a head whose target is ``T`` reads the columns ``T_chosen`` /
``T_rejected`` (``T_prompt``, ``T_margin``, ``T_chosen_ids`` / ``T_rejected_ids``) when the data
has them, else the plain ones; heads reading the same columns share their rows. The
``PreferenceCollator`` puts each source's chosen rows, then its rejected rows, into one batch
(TRL's layout) and gives each head its label (``losses/pairwise.py``): 1 on its chosen rows, 0
on its rejected rows, -100 on the other heads' rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import BatchError, ConfigError
from ..losses.objective import label_rule
from ..losses.pairwise import CHOSEN, NOT_READ, REJECTED
from .collator import HeadedCollator
from .examples import example_columns, map_examples

#: TRL's column names of tokenised pairs: (chosen, rejected[, chosen mask, rejected mask]).
TOKENIZED_PAIRS = (
    ("chosen_ids", "rejected_ids"),
    ("chosen_input_ids", "rejected_input_ids"),
    ("input_ids_chosen", "input_ids_rejected", "attention_mask_chosen", "attention_mask_rejected"),
)


def pairwise_targets(head_configs: Mapping[str, Any]) -> list[str]:
    """The targets of the heads with a pairwise loss, in head order (each once)."""
    targets = [
        c.target
        for c in head_configs.values()
        if c.loss_fct is not None and label_rule(c).task == "pairwise"
    ]
    return list(dict.fromkeys(targets))


def pair_sources(head_configs: Mapping[str, Any], columns: Iterable[str]) -> dict[str, str]:
    """Each pairwise target → the column prefix its pairs come from: ``"T_"`` when the data
    has ``T_chosen`` (or ``T_chosen_ids``), else ``""`` (the plain columns)."""
    columns = set(columns)
    firsts = ["chosen", *(names[0] for names in TOKENIZED_PAIRS)]
    out = {}
    for t in pairwise_targets(head_configs):
        own = any(f"{t}_{n}" in columns for n in firsts)
        out[t] = f"{t}_" if own else ""
    return out


def has_texts(head_configs: Mapping[str, Any], columns: Iterable[str]) -> bool:
    """Whether preference data with these columns holds texts (to tokenise) for any source."""
    columns = set(columns)
    return any(f"{p}chosen" in columns for p in pair_sources(head_configs, columns).values())


def is_preference_data(columns: Iterable[str], head_configs: Mapping[str, Any]) -> bool:
    """Whether a dataset with these columns holds pairs for the model's reward heads."""
    columns = set(columns)
    for prefix in set(pair_sources(head_configs, columns).values()):
        names = [f"{prefix}chosen", *(f"{prefix}{p[0]}" for p in TOKENIZED_PAIRS)]
        if any(n in columns for n in names):
            return True
    return False


# ---------------------------------------------------------------------- tokenising
def is_conversation(value: Any) -> bool:
    """A list of ``{"role", "content"}`` messages (TRL's conversational format)."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value)
    )


def tokenize_text(tokenizer: Any, value: Any, example: Mapping[str, Any] | None = None) -> list:
    """Token ids of one side of a pair, as TRL's RewardTrainer makes them: a conversation
    through the chat template, a text with the eos appended (unless it ends with it)."""
    example = example or {}
    if is_conversation(value):
        tools = example.get("tools")
        tools = json.loads(tools) if isinstance(tools, str) else tools
        kwargs = {"tools": tools, **(example.get("chat_template_kwargs") or {})}
        out = tokenizer.apply_chat_template(value, tokenize=True, return_dict=True, **kwargs)
        return list(out["input_ids"])
    if not isinstance(value, str):
        raise BatchError(
            f"preference data: a side of a pair is a {type(value).__name__}; expected a text or "
            "a list of {'role', 'content'} messages"
        )
    eos = getattr(tokenizer, "eos_token", None)
    if eos and not value.endswith(eos):
        value = value + eos
    return list(tokenizer(text=value)["input_ids"])


def tokenize_pair(example: Mapping[str, Any], tokenizer: Any, prefix: str = "") -> dict[str, Any]:
    """``{prefix}chosen_ids``, ``{prefix}rejected_ids`` (and ``{prefix}margin``) of one
    example, from its texts or its tokenised columns (any of TRL's names)."""
    out: dict[str, Any] = {}
    margin = example.get(f"{prefix}margin")
    if margin is not None:
        out[f"{prefix}margin"] = float(margin)
    for names in TOKENIZED_PAIRS:
        if f"{prefix}{names[0]}" in example and f"{prefix}{names[1]}" in example:
            chosen, rejected = example[f"{prefix}{names[0]}"], example[f"{prefix}{names[1]}"]
            if len(names) == 4:  # TRL 0.x: ids with their masks (maybe padded)
                chosen = _unpadded(chosen, example.get(f"{prefix}{names[2]}"))
                rejected = _unpadded(rejected, example.get(f"{prefix}{names[3]}"))
            out[f"{prefix}chosen_ids"] = [int(i) for i in chosen]
            out[f"{prefix}rejected_ids"] = [int(i) for i in rejected]
            return out
    if f"{prefix}chosen" not in example or f"{prefix}rejected" not in example:
        raise BatchError(
            f"preference data: an example has no {prefix}chosen / {prefix}rejected pair "
            f"(keys: {sorted(example)}); expected texts, conversations or "
            f"{prefix}chosen_ids / {prefix}rejected_ids"
        )
    chosen, rejected = example[f"{prefix}chosen"], example[f"{prefix}rejected"]
    prompt = example.get(f"{prefix}prompt", example.get("prompt"))
    if prompt is not None:  # TRL: the prompt is prepended to both sides
        if is_conversation(chosen) != is_conversation(prompt):
            raise BatchError(
                "preference data: the prompt and the chosen text must both be texts or both be "
                "conversations"
            )
        chosen, rejected = prompt + chosen, prompt + rejected
    out[f"{prefix}chosen_ids"] = tokenize_text(tokenizer, chosen, example)
    out[f"{prefix}rejected_ids"] = tokenize_text(tokenizer, rejected, example)
    return out


def _unpadded(ids: Sequence[int], mask: Sequence[int] | None) -> list[int]:
    if mask is None:
        return list(ids)
    if len(mask) != len(ids):
        raise BatchError(
            f"preference data: an attention mask of length {len(mask)} for {len(ids)} token ids"
        )
    return [int(i) for i, m in zip(ids, mask) if m]


def tokenize_preferences(
    data: Any,
    tokenizer: Any,
    head_configs: Mapping[str, Any],
    *,
    max_length: int | None = 1024,
) -> Any:
    """Preference data (a ``datasets.Dataset``, a streamed ``IterableDataset``, a list of
    dicts) → the same kind (a list for other iterables) with the
    columns ``PreferenceCollator`` reads: ``chosen_ids`` / ``rejected_ids`` / ``margin`` for
    heads reading the plain columns, ``T_chosen_ids`` ... for a head reading its own; pairs
    longer than ``max_length`` (either side; None: no limit) are dropped, as TRL does."""
    if not pairwise_targets(head_configs):
        raise ConfigError(
            "preference data needs a reward head: a head with loss_fct='bradley_terry' "
            "(pred_for_sequence=True, num_outputs=1)"
        )
    if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
        raise ConfigError(f"max_length={max_length!r} is invalid; an integer >= 1 or None")
    columns = example_columns(data, "preference data")
    prefixes = sorted(set(pair_sources(head_configs, columns).values()))

    def encode(example: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for prefix in prefixes:
            out.update(tokenize_pair(example, tokenizer, prefix))
        return out

    def short(example: Mapping[str, Any]) -> bool:
        return max_length is None or all(
            len(example[f"{p}{side}_ids"]) <= max_length
            for p in prefixes
            for side in ("chosen", "rejected")
        )

    keep = short if max_length is not None else None
    return map_examples(data, encode, keep, desc="Tokenizing pairs")


def pair_columns(head_configs: Mapping[str, Any], columns: Iterable[str]) -> list[str]:
    """The tokenised columns ``PreferenceCollator`` reads (what Trainer must not drop)."""
    prefixes = set(pair_sources(head_configs, columns).values())
    return [f"{p}{c}" for p in sorted(prefixes) for c in ("chosen_ids", "rejected_ids", "margin")]


# ---------------------------------------------------------------------- collating
class PreferenceCollator:
    """Collate tokenised preference examples into one batch for a HeadedModel's reward heads.

    For each source of pairs (``pair_sources``): every example's chosen row, then every
    example's rejected row (TRL's layout), padded on the right (``HeadedCollator`` pads); each
    reward head's label is 1 on its chosen rows, 0 on its rejected rows, -100 elsewhere, with
    the margin as a second column where the examples have one. Raw (untokenised) examples are
    tokenised on the fly with ``tokenizer`` (``tokenize_pair``)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        pad_token_id: int | None = None,
        pad_to_multiple_of: int | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self._configs = dict(model.head_configs)
        if not pairwise_targets(self._configs):
            raise ConfigError(
                "PreferenceCollator: the model has no reward head (loss_fct='bradley_terry')"
            )
        self._pad = HeadedCollator(
            model,
            tokenizer,
            pad_token_id=pad_token_id,
            padding_side="right",
            pad_to_multiple_of=pad_to_multiple_of,
        )

    @property
    def columns(self) -> list[str]:
        """Every column this collator may read (texts, tokenised pairs, margins, prompts), so
        that ``evaluate_head_wise`` keeps them."""
        names = ["chosen", "rejected", "prompt", "margin", "tools", "chat_template_kwargs"]
        names += [n for pair in TOKENIZED_PAIRS for n in pair]
        own = [f"{t}_{n}" for t in pairwise_targets(self._configs) for n in names]
        return names + own

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Pad the pairs of ``features`` into one batch with each reward head's labels."""
        if not isinstance(features, Sequence) or not features:
            raise BatchError(
                "PreferenceCollator: features must be a non-empty list of preference examples"
            )
        sources = pair_sources(self._configs, features[0].keys())
        rows: list[dict[str, Any]] = []
        spans: dict[str, tuple[int, int]] = {}  # prefix → (first row, pairs)
        margins: dict[str, list[float] | None] = {}
        for prefix in dict.fromkeys(sources.values()):
            pairs = [self._pair(f, prefix) for f in features]
            spans[prefix] = (len(rows), len(pairs))
            rows += [{"input_ids": c} for c, _, _ in pairs]
            rows += [{"input_ids": r} for _, r, _ in pairs]
            given = [m for _, _, m in pairs if m is not None]
            if given and len(given) != len(pairs):
                raise BatchError(
                    f"PreferenceCollator: {len(given)} of {len(pairs)} examples have a "
                    f"{prefix}margin; give every example one or none"
                )
            margins[prefix] = [float(m) for _, _, m in pairs] if given else None
        for target, prefix in sources.items():
            start, n = spans[prefix]
            given = margins[prefix]
            for i, row in enumerate(rows):
                k = i - start
                role = CHOSEN if 0 <= k < n else REJECTED if n <= k < 2 * n else NOT_READ
                if given is None:
                    row[target] = float(role)
                else:  # (role, margin): the margin is read on the chosen row
                    row[target] = [float(role), given[k] if role == CHOSEN else 0.0]
        return self._pad(rows)

    def _pair(self, example: Mapping[str, Any], prefix: str) -> tuple[list, list, Any]:
        key = f"{prefix}chosen_ids"
        if key not in example:
            if self.tokenizer is None:
                raise BatchError(
                    f"PreferenceCollator: an example has no {key!r} and there is no tokenizer "
                    "to tokenise its texts; pass tokenizer= (or processing_class= to the trainer)"
                )
            example = {**example, **tokenize_pair(example, self.tokenizer, prefix)}
        return (
            list(example[key]),
            list(example[f"{prefix}rejected_ids"]),
            example.get(f"{prefix}margin"),
        )
