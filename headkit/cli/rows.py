"""Table rows to a HeadedModel's examples, and its predictions back to table cells.

How a head's labels look in a data file follows its task (``HeadConfig.task``, asked of the
loss's ``LossSpec``): classifier labels are any strings or numbers, mapped to indices in sorted
order (the classes travel in the head's ``extra["classes"]`` and predictions are written back
as them); binary and regression heads read numbers. Token heads (``pred_for_sequence=False``)
read one label per word, given to the word's first sub-token.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import HeadConfig
from ..data.encoding import align_labels, as_class, encode_texts, encode_words
from ..errors import ConfigError
from ..losses.objective import IGNORE_INDEX, decisions, probabilities, target_rules
from .datafiles import as_list, as_number


def _targets(configs: list[HeadConfig]) -> dict[str, dict[str, bool]]:
    """Per target: whether it is token-level and whether it holds classes (the label rule:
    ``losses.objective.target_rules``; binary targets are read as numbers)."""
    out: dict[str, dict[str, bool]] = {}
    for target, rule in target_rules(configs).items():
        classes = {r.task == "classification" for r in rule.heads.values()}
        if len(classes) > 1:
            raise ConfigError(
                f"heads {sorted(rule.heads)} on target {target!r} disagree on class labels "
                "(a classifier and a binary or regression head); give them different targets"
            )
        out[target] = {"token": rule.layout == "token", "classes": classes.pop()}
    return out


def _classes_of(rows: list[dict], column: str, token: bool) -> list:
    values = set()
    for i, r in enumerate(rows):
        cell = r[column]
        values.update(as_class(v) for v in (as_list(cell, column, i) if token else [cell]))
    try:
        return sorted(values)
    except TypeError:
        return sorted(values, key=repr)


def _label(cell: Any, column: str, row: int, kind: dict[str, bool], classes: list | None) -> Any:
    def one(v: Any) -> Any:
        if not kind["classes"]:
            return as_number(v, column, row)
        c = as_class(v)
        if c not in classes:
            raise ConfigError(
                f"column {column!r}, row {row}: class {c!r} was not seen in training; "
                f"known classes: {classes}"
            )
        return classes.index(c)

    return [one(v) for v in as_list(cell, column, row)] if kind["token"] else one(cell)


def with_classes(
    configs: list[HeadConfig], rows: list[dict], label_columns: dict[str, str], where: str
) -> list[HeadConfig]:
    """Record each classifier's classes (sorted) and default its num_outputs to their count."""
    kinds = _targets(configs)
    unknown = sorted(set(label_columns) - set(kinds))
    if unknown:
        raise ConfigError(
            f"{where}: label_columns has target(s) {unknown} that no head reads; targets: "
            f"{sorted(kinds)}"
        )
    out = []
    for c in configs:
        if c.target not in label_columns:
            raise ConfigError(f"{where}: head {c.name!r} needs label_columns[{c.target!r}]")
        if kinds[c.target]["classes"]:
            classes = _classes_of(rows, label_columns[c.target], kinds[c.target]["token"])
            n = c.num_outputs or len(classes)
            if n < len(classes):
                raise ConfigError(
                    f"head {c.name!r}: num_outputs={n} but column {label_columns[c.target]!r} "
                    f"has {len(classes)} classes ({classes[:20]})"
                )
            c = c.replace(num_outputs=n, extra={**c.extra, "classes": classes})
        out.append(c)
    return out


def encode_rows(
    rows: list[dict],
    tokenizer: Any,
    configs: list[HeadConfig],
    text_column: str,
    label_columns: dict[str, str] | None,
    max_length: int,
) -> tuple[list[dict], list[list[int]] | None]:
    """Examples for a HeadedModel and, with token heads, each example's word index per token.

    ``label_columns`` maps targets to columns (None: no labels, for predict); classes come
    from each head's ``extra["classes"]``.
    """
    kinds = _targets(configs)
    for target, column in (label_columns or {}).items():
        if target not in kinds:
            heads = ", ".join(f"{c.name} (target {c.target})" for c in configs[:20])
            raise ConfigError(
                f"--label-column {str(target)[:80]}={str(column)[:80]}: no head has target "
                f"{str(target)[:80]!r}; the heads: {heads}"
            )
    words = any(k["token"] for k in kinds.values())
    if words:
        texts = [as_list(r[text_column], text_column, i) for i, r in enumerate(rows)]
        examples, word_index = encode_words(tokenizer, texts, max_length)
    else:
        texts = [str(r[text_column]) for r in rows]
        examples, word_index = encode_texts(tokenizer, texts, max_length), None
    classes = {c.target: c.extra.get("classes") for c in configs}
    for target, column in (label_columns or {}).items():
        kind = kinds[target]
        for i, (r, ex) in enumerate(zip(rows, examples)):
            y = _label(r[column], column, i, kind, classes[target])
            if kind["token"]:
                if len(y) != len(texts[i]):
                    raise ConfigError(
                        f"column {column!r}, row {i}: {len(y)} labels for {len(texts[i])} words"
                    )
                y = align_labels(word_index[i], y, IGNORE_INDEX)
            ex[target] = y
    return examples, word_index


def readable(name: str, cfg: HeadConfig, p: torch.Tensor) -> dict[str, Any]:
    """Output cells of one input: ``p`` is (num_outputs,) for a sequence head and
    (words, num_outputs) for a token head (one list entry per word).

    Classifiers give the class and its probability (sequence heads also every class's, as
    ``<name>_prob_<class>``), binary heads the 0/1 decision and the probability, regressors
    and reward heads (pairwise) the value(s); probabilities and decisions follow the head's
    calibration (``temperature``, ``threshold``: ``losses.objective.probabilities`` /
    ``decisions``).
    """
    task = cfg.task
    if task in ("regression", "pairwise"):
        values = p[..., 0] if p.shape[-1] == 1 else p
        return {name: values.tolist()}
    if task == "binary":  # the head's calibration (temperature, threshold) applies
        decision, prob = decisions(cfg, p), probabilities(cfg, p)
        if p.shape[-1] == 1:
            decision, prob = decision[..., 0], prob[..., 0]
        return {name: decision.tolist(), f"{name}_prob": prob.tolist()}
    classes = cfg.extra.get("classes") or list(range(p.shape[-1]))
    probs = probabilities(cfg, p)
    index = decisions(cfg, p)
    top = probs.gather(-1, index[..., None])[..., 0]
    names = [classes[i] if i < len(classes) else i for i in index.reshape(-1).tolist()]
    if p.dim() > 1:  # a token head: one class and probability per word
        return {name: names, f"{name}_prob": top.tolist()}
    cells = {name: names[0], f"{name}_prob": top.item()}
    for i, q in enumerate(probs.tolist()):
        cells[f"{name}_prob_{classes[i] if i < len(classes) else i}"] = q
    return cells
