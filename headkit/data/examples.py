"""Examples in the forms trainers take them: a ``datasets.Dataset``, a streamed
``datasets.IterableDataset`` (``load_dataset(..., streaming=True)``; its columns may be
unknown until read), a list of dicts, or any re-iterable of dicts. One place that reads their
column names and maps a function over them, keeping the form (a streamed dataset stays lazy).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import BatchError


def is_streamed(data: Any) -> bool:
    """Whether ``data`` is a ``datasets.IterableDataset`` (mapped lazily, never listed)."""
    return type(data).__name__ == "IterableDataset" and hasattr(data, "map")


def example_columns(data: Any, what: str = "data") -> list[str]:
    """The column names of ``data``: its ``column_names``, or the keys of its first example (a
    streamed dataset whose features are unknown, a list or iterable of dicts)."""
    names = getattr(data, "column_names", None)
    if names is not None:
        return list(names)
    try:
        first = next(iter(data))
    except StopIteration:
        raise BatchError(f"{what}: the dataset is empty") from None
    if not isinstance(first, Mapping):
        raise BatchError(f"{what}: an example is a {type(first).__name__}; expected a dict")
    return list(first)


def map_examples(
    data: Any,
    fn: Callable[[Mapping[str, Any]], dict[str, Any]],
    keep: Callable[[dict[str, Any]], bool] | None = None,
    desc: str | None = None,
) -> Any:
    """``fn`` over every example, dropping those ``keep`` refuses: a ``Dataset`` stays a
    ``Dataset`` (its old columns removed), a streamed dataset a lazy ``IterableDataset``, and
    anything else becomes a list."""
    if is_streamed(data):
        out = data.map(fn, remove_columns=example_columns(data))
        return out.filter(keep) if keep is not None else out
    if hasattr(data, "map") and getattr(data, "column_names", None) is not None:
        out = data.map(fn, remove_columns=list(data.column_names), desc=desc)
        return out.filter(keep) if keep is not None else out
    encoded = (fn(x) for x in data)
    return [e for e in encoded if keep is None or keep(e)]
