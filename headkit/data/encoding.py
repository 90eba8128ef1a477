"""Texts or words → token examples, and word labels → sub-token labels.

One home for the rules label readers rely on: ``as_class`` (what a class label is), and for
token-level tasks: a word's label goes to its **first**
sub-token; later sub-tokens of the word and special tokens get -100 (ignored by losses and
metrics). Examples are unpadded ``{"input_ids": [...], "token_type_ids": [...]}`` dicts, ready
for ``HeadedCollator`` and ``cache_features``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError
from ..losses.objective import IGNORE_INDEX

#: Tokenizer outputs kept in an example (the collator builds ``attention_mask`` itself).
_KEEP = ("input_ids", "token_type_ids")


def split_words(value: Any, what: str = "text") -> list[str]:
    """A list of words as given, or a string split on whitespace."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, Sequence) and all(isinstance(w, str) for w in value):
        return list(value)
    raise ConfigError(
        f"{what}={value!r} is invalid for a token task; a list of words or a string of "
        "whitespace-separated words"
    )


def encode_texts(tokenizer: Any, texts: Sequence[str], max_length: int = 128) -> list[dict]:
    """One unpadded example per text, truncated to ``max_length`` tokens."""
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise ConfigError(f"text {i} is {type(t).__name__} ({t!r}); expected a string")
    enc = tokenizer(list(texts), truncation=True, max_length=max_length)
    examples = [{k: enc[k][i] for k in _KEEP if k in enc} for i in range(len(texts))]
    _check_nonempty(examples)
    return examples


def encode_words(
    tokenizer: Any, words: Sequence[Sequence[str]], max_length: int = 128
) -> tuple[list[dict], list[list[int]]]:
    """Examples of pre-split words and, per example, the word index each token position is
    labelled with: the word's number at its first sub-token, -1 everywhere else."""
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(
            f"token tasks need a fast tokenizer (for word_ids()); {type(tokenizer).__name__} "
            "is not one"
        )
    try:
        enc = tokenizer(
            [list(w) for w in words],
            is_split_into_words=True,
            truncation=True,
            max_length=max_length,
        )
    except (TypeError, ValueError) as e:  # e.g. GPT-2 style tokenizers without add_prefix_space
        raise ConfigError(
            f"the tokenizer cannot take pre-split words ({e}); load it with "
            "AutoTokenizer.from_pretrained(path, add_prefix_space=True)"
        ) from None
    examples = [{k: enc[k][i] for k in _KEEP if k in enc} for i in range(len(words))]
    _check_nonempty(examples)
    return examples, [first_subtokens(enc.word_ids(i)) for i in range(len(words))]


def first_subtokens(word_ids: Sequence[int | None]) -> list[int]:
    """Per position: the word index at a word's first sub-token, -1 elsewhere."""
    out, previous = [], None
    for w in word_ids:
        out.append(w if w is not None and w != previous else -1)
        previous = w
    return out


def align_labels(word_index: Sequence[int], labels: Sequence[Any], fill: Any = IGNORE_INDEX):
    """Labels per token position: ``labels[word]`` at a first sub-token, ``fill`` elsewhere."""
    return [labels[w] if w >= 0 else fill for w in word_index]


def _check_nonempty(examples: list[dict]) -> None:
    for i, ex in enumerate(examples):
        if not ex["input_ids"]:
            raise ConfigError(f"text {i} has no tokens after tokenization; remove empty texts")


def as_class(value: Any) -> Any:
    """A class label as a hashable Python value, one rule for every reader of labels.

    Integers, integral floats and strings that spell them (``1``, ``1.0``, ``"1"``, ``" 1.0"``)
    are the integer class 1; NumPy and torch scalars are read as their Python value; other
    strings are kept as they are (stripped of surrounding whitespace). A list is refused: one
    class per example.
    """
    if hasattr(value, "item") and not isinstance(value, (list, tuple)):
        value = value.item()
    if isinstance(value, (list, tuple)):
        raise ConfigError(f"label {value!r} is a list; a classification label is one class")
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            number = float(text)
        except ValueError:
            return text
        return int(number) if number.is_integer() and text.lower() not in ("inf", "nan") else text
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value
