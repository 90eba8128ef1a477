"""Which head reads which label: routing a batch's label keys to head targets.

A batch passes labels by each head's ``target`` (``sentiment=tensor``), as a dict under
``labels`` (``labels={"sentiment": tensor}``: what ``HeadedCollator`` makes, and the key HF
Trainer treats as the batch's labels), or, for a model with exactly one head that has a
loss, as a plain tensor under ``labels`` (what ``DataCollatorWithPadding`` makes of a
``label`` column, and what ``model(..., labels=tensor)`` means in transformers).
``HeadedModel.forward``, feature caching and ``HeadedTrainer`` all route labels here.
``forward``'s signature is the class's and lists ``labels``, not the targets: the columns
a model reads are ``model_columns`` (what ``HeadedTrainer`` keeps).

A label whose target only heads with ``loss_fct=None`` read would be silently ignored by
``HeadedModel.forward``; it is refused there (``BatchError``) unless the model was built with
``allow_unused_labels=True``. Evaluation (metrics of loss-free heads) keeps such labels for
itself and calls the model without them (``without_unused_labels``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, Dataset, IterableDataset

from ..backbone.inputs import BATCH_INPUTS, MODEL_INPUTS
from ..errors import BatchError

if TYPE_CHECKING:
    from ..config import HeadConfig

logger = logging.getLogger("headkit")

#: Columns transformers' collators rename to ``labels`` (DataCollatorWithPadding, ...).
RENAMED_TO_LABELS = ("label", "label_ids")


def loss_heads(head_configs: Mapping[str, Any]) -> list[str]:
    """Names of the heads that have a loss (``loss_fct`` is not None)."""
    return [n for n, c in head_configs.items() if c.loss_fct is not None]


def single_loss_target(head_configs: Mapping[str, Any]) -> str | None:
    """The target of the one head with a loss, or None when there are several or none."""
    heads = loss_heads(head_configs)
    return head_configs[heads[0]].target if len(heads) == 1 else None


def route_labels(
    head_configs: Mapping[str, Any],
    labels: dict[str, Any],
    inputs: Iterable[str] = MODEL_INPUTS,
) -> dict[str, Any]:
    """``{target: label}`` from a batch's label keys; a BatchError for keys no head reads
    (naming the targets and the model's ``inputs``)."""
    targets = {c.target for c in head_configs.values()}
    labels = dict(labels)
    given = labels.get("labels")
    if isinstance(given, Mapping):
        del labels["labels"]
        twice = sorted(set(given) & set(labels))
        if twice:
            raise BatchError(
                f"target(s) {twice} given twice, in labels={{...}} and as keyword "
                "argument(s); pass each label once"
            )
        labels = {**given, **labels}
    elif given is not None and "labels" not in targets:
        del labels["labels"]
        target = _target_of_plain_labels(head_configs)
        if target in labels and labels[target] is not None:
            raise BatchError(
                f"target {target!r} given twice, as labels=<tensor> and as {target}=...; "
                "pass each label once"
            )
        labels[target] = given
    unknown = [k for k in labels if k not in targets]
    if unknown:
        raise BatchError(
            f"unexpected batch key(s) {unknown}: not a model input and no head has that "
            f"target; targets: {sorted(targets)}; inputs: {list(inputs)}"
        )
    return labels


def _target_of_plain_labels(head_configs: Mapping[str, Any]) -> str:
    target = single_loss_target(head_configs)
    if target is not None:
        return target
    heads = loss_heads(head_configs)
    described = ", ".join(f"{n!r} (target {head_configs[n].target!r})" for n in heads)
    has = f"{len(heads)} heads with a loss: {described}" if heads else "no head with a loss"
    renamed = [c.target for c in head_configs.values() if c.target in RENAMED_TO_LABELS]
    why = (
        f" (it renamed your {renamed[0]!r} column, a head's target, to 'labels')" if renamed else ""
    )
    raise BatchError(
        f"batch key 'labels' holds a tensor, but this model has {has}, so it cannot tell "
        "whose labels they are. transformers' DataCollatorWithPadding (Trainer's default "
        "collator when processing_class is a tokenizer) renames a 'label' or 'label_ids' "
        f"column to 'labels'{why}. Either give the head that learns from that column "
        "target='labels' (HeadConfig(..., target='labels')), or keep each head's labels "
        "under its target and collate with HeadedCollator(model, tokenizer) "
        "(HeadedTrainer, or Trainer(..., data_collator=HeadedCollator(model, tokenizer)) "
        "with TrainingArguments(remove_unused_columns=False))"
    )


# ---------------------------------------------------------------------- loss-free heads
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


# ---------------------------------------------------------------------- dataset columns
def model_columns(head_configs: Mapping[str, Any], inputs: Iterable[str] = ()) -> set[str]:
    """Columns a HeadedModel reads: batch inputs (and the backbone's own ``inputs``:
    ``pixel_values``, ...), head targets and the label columns Trainer keeps (``labels``,
    ``label``, ``label_ids``)."""
    targets = (c.target for c in head_configs.values())
    return {*BATCH_INPUTS, *inputs, *targets, "labels", *RENAMED_TO_LABELS}


def keep_model_columns(
    data: Any, head_configs: Mapping[str, Any], where: str, inputs: Iterable[str] = ()
) -> Any:
    """``data`` without the columns the model does not read (as Trainer's
    ``remove_unused_columns``), saying once which were dropped.

    A ``datasets.Dataset`` loses them with ``remove_columns``; a list or dataset of dicts is
    wrapped so that each example loses them; a DataLoader is returned as it is (its batches
    are what the caller asked for).
    """
    keep = model_columns(head_configs, inputs)
    if isinstance(data, DataLoader):
        return data
    columns = getattr(data, "column_names", None)
    if isinstance(columns, list) and hasattr(data, "remove_columns"):  # datasets.Dataset
        unused = [c for c in columns if c not in keep]
        if unused:
            _say_dropped(where, unused)
            data = data.remove_columns(unused)
        return data
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        return _KeptColumns(data, keep, where)
    return _KeptColumnsIterable(data, keep, where)


def _say_dropped(where: str, columns: list[str]) -> None:
    logger.warning(
        "%s: ignoring column(s) %s, neither a model input nor a head target (as Trainer's "
        "remove_unused_columns does)",
        where,
        columns,
    )


class _ColumnFilter:
    def __init__(self, keep: set[str], where: str) -> None:
        self.keep, self.where, self.told = keep, where, False

    def __call__(self, example: Any) -> Any:
        if not isinstance(example, Mapping):
            return example
        unused = [k for k in example if k not in self.keep]
        if not unused:
            return example
        if not self.told:
            self.told = True
            _say_dropped(self.where, unused)
        return {k: v for k, v in example.items() if k in self.keep}


class _KeptColumns(Dataset):
    """A map-style view of ``data`` whose dict examples keep only the model's columns."""

    def __init__(self, data: Any, keep: set[str], where: str) -> None:
        self.data, self.filter = data, _ColumnFilter(keep, where)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        return self.filter(self.data[i])


class _KeptColumnsIterable(IterableDataset):
    """An iterable view of ``data`` whose dict examples keep only the model's columns."""

    def __init__(self, data: Any, keep: set[str], where: str) -> None:
        self.data, self.filter = data, _ColumnFilter(keep, where)

    def __iter__(self) -> Iterator[Any]:
        return (self.filter(x) for x in self.data)


# ---------------------------------------------------------------------- missing targets
def say_no_targets(head_configs: Mapping[str, Any]) -> None:
    """Say why a training-mode forward without a label for any head with a loss has no loss.

    ``HeadedModel.forward`` calls it once per model. Under a vanilla Trainer it is what a
    ``remove_unused_columns`` that dropped the target columns looks like: Trainer keeps the
    columns named in ``HeadedModel.forward``'s signature, which lists ``labels`` but not the
    heads' targets (``HeadedTrainer`` keeps them itself, from ``model_columns``).
    """
    targets = sorted({head_configs[n].target for n in loss_heads(head_configs)})
    logger.warning(
        "HeadedModel: a training-mode forward got no label for any head with a loss "
        "(targets %s), so it returns no loss. Under a Trainer, its remove_unused_columns "
        "dropped the target columns (a vanilla Trainer keeps only 'labels', 'label' and "
        "'label_ids' beside the inputs): train with headkit.HeadedTrainer, which keeps them, "
        "or with TrainingArguments(remove_unused_columns=False). For inference, call "
        "model.eval() first",
        targets,
    )
