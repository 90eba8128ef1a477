"""Which labels a batch may carry: each one must be read by a head that learns from it.

A label whose target only heads with ``loss_fct=None`` read would be silently ignored by
``HeadedModel.forward``; it is refused there (``BatchError``) unless the model was built with
``allow_unused_labels=True``. Evaluation (metrics of loss-free heads) keeps such labels for
itself and calls the model without them (``without_unused_labels``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import HeadConfig


def unused_targets(configs: Iterable[HeadConfig], given: Iterable[str]) -> dict[str, list[str]]:
    """The targets in ``given`` that no head with a loss reads → the loss-free heads reading
    each (targets no head reads at all are not listed: they are another error)."""
    configs = list(configs)
    learning = {c.target for c in configs if c.loss_fct is not None}
    out: dict[str, list[str]] = {}
    for target in given:
        readers = [c.name for c in configs if c.target == target]
        if readers and target not in learning:
            out[target] = readers
    return out


def without_unused_labels(batch: Mapping[str, Any], configs: Iterable[HeadConfig]) -> dict:
    """``batch`` without the labels only loss-free heads read, at the top level and under
    ``batch["labels"]`` (a ``{target: tensor}`` mapping)."""
    configs = list(configs)
    out = dict(batch)
    nested = out.get("labels")
    if isinstance(nested, Mapping):
        drop = unused_targets(configs, nested)
        out["labels"] = {k: v for k, v in nested.items() if k not in drop}
        if not out["labels"]:
            del out["labels"]
    for target in unused_targets(configs, [k for k in out if k != "labels"]):
        del out[target]
    return out
