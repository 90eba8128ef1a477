"""What a layer sweep probes: layer and pooling specs, rows and labels, splits, control labels.

A row is one text (sequence tasks) or one labelled word (token tasks: the word's first
sub-token). Splits are drawn per example, so all words of a sentence fall on one side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..data.encoding import as_class, encode_texts, encode_words, split_words
from ..errors import ConfigError
from ..heads.pooling import ALIASES, POOLINGS

TASKS = ("classification", "regression", "token", "pairwise")


def parse_layers(spec: str | int | Sequence[int], num_layers: int) -> list[int]:
    """Hidden-states indices (0 = embeddings, i = output of block i) from a layer spec.

    ``"all"``, ``"0,3,6"``, python-style slices ``"-4:"`` / ``"1:5"`` / ``"::2"``, a mix of
    those joined by commas, an int or a list of ints. Negative indices count from the end
    (-1 = the last layer, ``num_layers``). Returns sorted, distinct, non-negative indices.
    """
    total = num_layers + 1
    allowed = (
        f"allowed: 'all', indices {-total}..{num_layers} (0 = embeddings, -1 = last), "
        "comma-separated ('0,3,6') or slices ('-4:', '1:5')"
    )
    if isinstance(spec, bool):
        raise ConfigError(f"layers={spec!r} is invalid; {allowed}", field="layers", value=spec)
    if isinstance(spec, int):
        items: list[Any] = [spec]
    elif isinstance(spec, str):
        if spec.strip().lower() == "all":
            return list(range(total))
        items = [s.strip() for s in spec.split(",")]
    elif isinstance(spec, Sequence) and all(isinstance(i, int) for i in spec):
        items = list(spec)
    else:
        raise ConfigError(f"layers={spec!r} is invalid; {allowed}", field="layers", value=spec)
    chosen: set[int] = set()
    for item in items:
        if isinstance(item, str) and ":" in item:
            try:
                parts = [int(p) if p.strip() else None for p in item.split(":")]
                if len(parts) > 3:
                    raise ValueError
                chosen.update(range(total)[slice(*parts)])
            except ValueError:
                raise ConfigError(
                    f"layers={spec!r}: {item!r} is not a slice; {allowed}",
                    field="layers",
                    value=spec,
                ) from None
            continue
        try:
            index = int(item)
        except ValueError:
            raise ConfigError(
                f"layers={spec!r}: {item!r} is not an index; {allowed}", field="layers", value=spec
            ) from None
        if not -total <= index < total:
            raise ConfigError(
                f"layers={spec!r}: {index} is out of range; {allowed}", field="layers", value=spec
            )
        chosen.add(index % total)
    if not chosen:
        raise ConfigError(
            f"layers={spec!r} selects no layer; {allowed}", field="layers", value=spec
        )
    return sorted(chosen)


def parse_poolings(spec: str | Sequence[str]) -> list[str]:
    """Pooling names for a sweep: ``"mean"``, ``"mean,last"`` or a list; ``+`` concatenates.

    Only poolings without trainable parameters can be probed on cached vectors.
    """
    fixed = [n for n in POOLINGS.names() if not _has_parameters(n)]
    allowed = (
        f"allowed: {', '.join(fixed + sorted(ALIASES))}; ',' separates poolings to compare, "
        "'+' concatenates"
    )
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    out = []
    for name in names:
        if not isinstance(name, str) or not name:
            raise ConfigError(
                f"pooling={spec!r} is invalid; {allowed}", field="pooling", value=spec
            )
        parts = [ALIASES.get(p.strip().lower(), p.strip().lower()) for p in name.split("+")]
        for p in parts:
            if p not in POOLINGS:
                raise ConfigError(
                    f"pooling={spec!r}: {p!r} is not a pooling; {allowed}",
                    field="pooling",
                    value=spec,
                )
            if _has_parameters(p):
                raise ConfigError(
                    f"pooling={spec!r}: {p!r} has trainable parameters, and a sweep probes "
                    f"fixed vectors; {allowed}",
                    field="pooling",
                    value=spec,
                )
        canonical = "+".join(parts)
        if canonical not in out:
            out.append(canonical)
    if not out:
        raise ConfigError(
            f"pooling={spec!r} names no pooling; {allowed}", field="pooling", value=spec
        )
    return out


def _has_parameters(pooling: str) -> bool:
    return any(True for _ in POOLINGS.get(pooling)(8).parameters())


@dataclass
class ProbeRows:
    """What the probes train on: one row per text (or per labelled word, for token tasks)."""

    examples: list[dict]  # tokenized examples, in input order
    example: torch.Tensor  # (R,) example index of each row
    position: torch.Tensor | None  # (R,) token position of each row (token task)
    y: torch.Tensor  # (R,) class index or value
    keys: list[str]  # per row: the input text or word type (control task)
    classes: list[Any] | None
    target_scale: tuple[float, float] | None = None  # regression: raw = y * scale + shift


def prepare_rows(tokenizer, texts, labels, task, max_length) -> ProbeRows:
    if task != "token":
        examples = encode_texts(tokenizer, texts, max_length)
        y, classes = _label_tensor(list(labels), task == "regression", "labels")
        n = len(examples)
        scale = _target_scale(labels) if task == "regression" else None
        return ProbeRows(examples, torch.arange(n), None, y, list(texts), classes, scale)
    words = [split_words(t, f"texts[{i}]") for i, t in enumerate(texts)]
    per_word = [
        split_words(v, f"labels[{i}]") if isinstance(v, str) else list(v)
        for i, v in enumerate(labels)
    ]
    for i, (w, lab) in enumerate(zip(words, per_word)):
        if len(w) != len(lab):
            raise ConfigError(
                f"example {i} has {len(w)} words but {len(lab)} labels; one label per word"
            )
    examples, word_index = encode_words(tokenizer, words, max_length)
    example, position, flat, keys = [], [], [], []
    for i, wi in enumerate(word_index):
        for pos, w in enumerate(wi):
            if w >= 0:
                example.append(i)
                position.append(pos)
                flat.append(per_word[i][w])
                keys.append(words[i][w])
    if not flat:
        raise ConfigError("no word kept a token after truncation; nothing to probe")
    y, classes = _label_tensor(flat, False, "labels")
    return ProbeRows(examples, torch.tensor(example), torch.tensor(position), y, keys, classes)


def media_rows(examples: list[dict], keys: list[str], labels, task: str) -> ProbeRows:
    """Rows of a sweep over images or audio: one per example (``keys`` name each input for
    the control task); ``task="token"`` has no words to label."""
    if task == "token":
        raise ConfigError(
            "task='token' labels words; images and audio take task='classification' or "
            "'regression'",
            field="task",
            value="token",
        )
    y, classes = _label_tensor(list(labels), task == "regression", "labels")
    scale = _target_scale(labels) if task == "regression" else None
    return ProbeRows(examples, torch.arange(len(examples)), None, y, keys, classes, scale)


def _label_tensor(values: list, regression: bool, what: str) -> tuple[torch.Tensor, list | None]:
    if regression:
        return _regression_targets(values, what)[0], None
    values = [as_class(v) for v in values]
    try:
        classes = sorted(set(values))
    except TypeError:
        classes = sorted(set(values), key=repr)
    if len(classes) < 2:
        raise ConfigError(f"{what} hold a single class ({classes!r}); a probe needs at least 2")
    index = {c: i for i, c in enumerate(classes)}
    return torch.tensor([index[v] for v in values]), classes


def _target_scale(values: Any) -> tuple[float, float]:
    """(scale, shift) that map the standardised targets back: raw = y * scale + shift."""
    return _regression_targets(list(values), "labels")[1]


def _regression_targets(values: list, what: str) -> tuple[torch.Tensor, tuple[float, float]]:
    """Finite, varying targets, standardised (in float64, scaled first so that squares of
    large values cannot overflow). R^2 and the ridge fit's choice of L2 do not change under
    an affine map of the targets, so scores are those of the raw values, computed stably."""
    try:
        y = torch.tensor([float(v) for v in values], dtype=torch.float64)
    except (TypeError, ValueError):
        bad = next(v for v in values if not _is_number(v))
        raise ConfigError(f"{what}: {bad!r} is not a number (task='regression')") from None
    finite = torch.isfinite(y)
    if not bool(finite.all()):
        where = torch.nonzero(~finite)[:, 0].tolist()
        raise ConfigError(
            f"{what}: regression labels must be finite numbers; {len(where)} are not (at "
            f"{where[:10]}: {[values[i] for i in where[:3]]})"
        )
    peak = float(y.abs().max().clamp(min=1e-300))
    y = y / peak
    spread = float(y.std()) if len(y) > 1 else 0.0
    if not spread > 1e-12:
        raise ConfigError(
            f"{what}: every regression label is {values[0]!r}; R^2 needs targets that vary"
        )
    mean = float(y.mean())
    return ((y - mean) / spread).float(), (spread * peak, mean * peak)


def _is_number(v: Any) -> bool:
    try:
        float(v)
        return True
    except (TypeError, ValueError):
        return False


def split_rows(
    rows: ProbeRows,
    test_fraction: float,
    val_fraction: float,
    val_splits: int,
    seed: int,
    test_from: int | None = None,
    folds: int | None = None,
) -> dict[str, torch.Tensor]:
    """Row masks: "test", "train" (R,), and "fit" (S, R_train) per validation split; split by
    example. ``test_from``: the examples from this index on are a given test split (else
    ``test_fraction`` of the examples is held out at random). ``folds``: the validation
    splits are the ``folds`` folds of k-fold cross-validation (each training example
    validates once), else ``val_splits`` random draws of ``val_fraction``.

    Classification (sequence tasks) draws every split stratified: each class keeps its share
    in the held-out split, in every fold and in every validation split (``_stratified_order``).
    """
    n = len(rows.examples)
    strata = _example_classes(rows)
    is_test = torch.zeros(n, dtype=torch.bool)
    if test_from is None:
        order = _stratified_order(torch.arange(n), strata, seed)
        n_test = max(1, round(n * test_fraction))
        is_test[order[:n_test]] = True
    else:
        n_test = n - test_from
        is_test[test_from:] = True
    train_examples = torch.nonzero(~is_test)[:, 0]
    n_val = max(1, round(len(train_examples) * val_fraction))
    if folds is not None:
        n_val = -(-len(train_examples) // folds)  # the largest fold
    if len(train_examples) - n_val < 2 or (folds is not None and len(train_examples) < folds):
        how = f"{folds} folds" if folds is not None else f"validation ({n_val})"
        raise ConfigError(
            f"{n} examples leave {len(train_examples) - n_val} to train on after the held-out "
            f"({n_test}) and {how} splits; give more examples"
        )
    splits = folds if folds is not None else val_splits
    fit_examples = torch.ones(splits, n, dtype=torch.bool)
    if folds is not None:
        order = _grouped_order(train_examples, strata, seed * 1_000_003 + 7919)
        for s in range(folds):
            fit_examples[s, order[s::folds]] = False  # round robin: each class spread evenly
    else:
        for s in range(val_splits):
            order = _stratified_order(train_examples, strata, seed * 1_000_003 + 7919 * (s + 1))
            fit_examples[s, order[:n_val]] = False
    test = is_test[rows.example]
    train = ~test
    if rows.classes is None and bool(test.any()):
        held = rows.y[test]
        if bool((held == held[0]).all()):
            raise ConfigError(
                f"the {int(test.sum())} held-out regression labels are all equal; R^2 on them "
                "is undefined: give a test split whose labels vary"
            )
    fit = fit_examples[:, rows.example][:, train]
    if not bool(test.any()) or not bool(fit.any(1).all()) or not bool((~fit).any(1).all()):
        raise ConfigError(
            "the held-out, fit or validation split has no labelled rows; give more examples"
        )
    return {"test": test, "train": train, "fit": fit}


def _example_classes(rows: ProbeRows) -> torch.Tensor | None:
    """Each example's class, for stratified splits (None: regression or token tasks, whose
    examples hold many labels or none)."""
    if rows.classes is None or rows.position is not None:
        return None
    return rows.y


def _grouped_order(examples: torch.Tensor, strata: torch.Tensor | None, seed: int):
    """``examples`` shuffled with ``seed``, then grouped by class: dealing them round robin
    into k folds gives each fold its class's share (within one example)."""
    perm = examples[torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed))]
    if strata is None:
        return perm
    return perm[torch.sort(strata[perm], stable=True).indices]


def _stratified_order(examples: torch.Tensor, strata: torch.Tensor | None, seed: int):
    """``examples`` in a random order (drawn with ``seed``) in which every prefix holds each
    class in its share: an example's key is (its rank among its class, shuffled) / (its
    class's count), so taking the first k (or every k-th) stratifies. Without ``strata``:
    a plain random order."""
    perm = examples[torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed))]
    if strata is None:
        return perm
    cls = strata[perm]
    counts = torch.bincount(cls)
    rank = torch.zeros(len(perm), dtype=torch.float64)
    for c in torch.unique(cls).tolist():
        members = cls == c
        rank[members] = torch.arange(int(members.sum()), dtype=torch.float64)
    key = (rank + 0.5) / counts[cls].double()
    return perm[torch.sort(key, stable=True).indices]


def control_labels(rows: ProbeRows, train: torch.Tensor, seed: int) -> torch.Tensor:
    """Each distinct text / word type gets a label drawn from the training rows' labels."""
    g = torch.Generator().manual_seed(seed + 104729)
    pool = rows.y[train]
    distinct = {k: None for k in rows.keys}
    draws = pool[torch.randint(len(pool), (len(distinct),), generator=g)]
    table = dict(zip(distinct, draws.tolist()))
    return torch.tensor([table[k] for k in rows.keys], dtype=rows.y.dtype)
