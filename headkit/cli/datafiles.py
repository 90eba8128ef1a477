"""Tables of examples for the command line: read them, check their columns, write predictions.

Readable: CSV (``.csv``, ``.tsv``), JSON Lines (``.jsonl``, ``.ndjson``), JSON (``.json``, a list
of objects), Parquet (``.parquet``, ``.pq``; needs pyarrow), a folder written by a
``datasets`` ``save_to_disk`` (needs datasets), and ``packaged:rotten_tomatoes`` (the packaged
review snippets: columns ``text``, ``label``). CSV cells are strings; ``as_number`` and
``as_class`` turn label cells into numbers where they look like numbers.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError

FORMATS = (
    "CSV (.csv, .tsv), JSON Lines (.jsonl, .ndjson), JSON (.json), Parquet (.parquet, .pq), "
    "a datasets.save_to_disk folder, or packaged:rotten_tomatoes"
)
PACKAGED_DATA = ("packaged:rotten_tomatoes",)


def read_rows(source: str | os.PathLike, limit: int | None = None) -> list[dict[str, Any]]:
    """The rows of a data file as dicts (at most ``limit``)."""
    name = str(source)
    if name.startswith("packaged:"):
        return _packaged(name, limit)
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"data file {name!r} does not exist; allowed: {FORMATS}")
    suffix = path.suffix.lower()
    if path.is_dir():
        rows = _datasets_dir(path, limit)
    elif suffix in (".csv", ".tsv"):
        rows = _csv(path, "\t" if suffix == ".tsv" else ",", limit)
    elif suffix in (".jsonl", ".ndjson"):
        rows = _jsonl(path, limit)
    elif suffix == ".json":
        rows = _json(path, limit)
    elif suffix in (".parquet", ".pq"):
        rows = _parquet(path, limit)
    else:
        raise ConfigError(f"data file {name!r}: unknown format {suffix!r}; allowed: {FORMATS}")
    if not rows:
        raise ConfigError(f"data file {name!r} holds no rows")
    return rows


def columns_of(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Column names in first-seen order."""
    return list(dict.fromkeys(k for r in rows[:1000] for k in r))


def require_columns(
    rows: Sequence[Mapping[str, Any]], wanted: Mapping[str, str], source: str
) -> None:
    """Raise ConfigError naming the option, the column and the columns present if one is
    missing. ``wanted`` maps an option name (``--text-column``) to the column it names."""
    present = columns_of(rows)
    for option, column in wanted.items():
        if column not in present:
            raise ConfigError(
                f"{option}={column!r}: no such column in {source}; columns present: "
                f"{', '.join(present)}"
            )
        missing = next((i for i, r in enumerate(rows) if r.get(column) is None), None)
        if missing is not None:
            raise ConfigError(
                f"{option}={column!r}: row {missing} of {source} has no value in that column"
            )


def as_number(value: Any, column: str, row: int) -> float | list:
    """A float (or a list of floats) from a cell; CSV strings are parsed, JSON lists kept."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            value = _json_cell(text, column, row)
        else:
            try:
                return float(text)
            except ValueError:
                raise ConfigError(
                    f"column {column!r}, row {row}: {value!r} is not a number"
                ) from None
    if isinstance(value, (list, tuple)):
        return [as_number(v, column, row) for v in value]
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        and not hasattr(value, "item")
    ):
        raise ConfigError(f"column {column!r}, row {row}: {value!r} is not a number")
    return float(value)


def as_list(value: Any, column: str, row: int) -> list:
    """A per-word list from a cell: a list, a JSON list string, or whitespace-separated text."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if hasattr(value, "tolist"):
        return list(value.tolist())
    if isinstance(value, str):
        text = value.strip()
        return _json_cell(text, column, row) if text.startswith("[") else text.split()
    raise ConfigError(f"column {column!r}, row {row}: {value!r} is not a list of words/labels")


def write_rows(path: str | os.PathLike, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write rows as CSV (``.csv``/``.tsv``; list cells as JSON) or JSON Lines (``.jsonl``)."""
    out = Path(path)
    suffix = out.suffix.lower()
    if suffix not in (".csv", ".tsv", ".jsonl", ".ndjson"):
        raise ConfigError(
            f"--output={str(path)!r}: unknown format {suffix!r}; allowed: .csv, .tsv, .jsonl"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        if suffix in (".jsonl", ".ndjson"):
            for r in rows:
                f.write(json.dumps(dict(r), ensure_ascii=False) + "\n")
        else:
            writer = csv.DictWriter(
                f, fieldnames=columns_of(rows), delimiter="\t" if suffix == ".tsv" else ","
            )
            writer.writeheader()
            for r in rows:
                writer.writerow({k: _csv_cell(v) for k, v in r.items()})
    os.replace(tmp, out)
    return out


# ---------------------------------------------------------------------- readers
def _csv(path: Path, delimiter: str, limit: int | None) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        return _take(reader, limit)


def _jsonl(path: Path, limit: int | None) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: line {i + 1} is not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}: line {i + 1} is not a JSON object")
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    return rows


def _json(path: Path, limit: int | None) -> list[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ConfigError(f"{path}: a .json data file must hold a list of objects")
    return data[:limit] if limit is not None else data


def _parquet(path: Path, limit: int | None) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"{path}: reading Parquet needs pyarrow: pip install pyarrow (or headkit[data])"
        ) from None
    table = pq.read_table(path)
    if limit is not None:
        table = table.slice(0, limit)
    return table.to_pylist()


def _datasets_dir(path: Path, limit: int | None) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"{path}: reading a saved dataset needs datasets: pip install datasets "
            "(or headkit[data])"
        ) from None
    try:
        data = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(
            f"{path} is a folder but not a dataset saved with save_to_disk ({e}); allowed: "
            f"{FORMATS}"
        ) from None
    if isinstance(data, datasets.DatasetDict):
        splits = list(data)
        raise ConfigError(
            f"{path} holds a DatasetDict with splits {splits}; pass one split's folder, e.g. "
            f"{path / splits[0]}"
        )
    if limit is not None:
        data = data.select(range(min(limit, len(data))))
    return data.to_list()


def _packaged(name: str, limit: int | None) -> list[dict]:
    if name != "packaged:rotten_tomatoes":
        raise ConfigError(f"data={name!r} is unknown; allowed: {', '.join(PACKAGED_DATA)}")
    from ..packaged import rotten_tomatoes

    return [{"text": t, "label": y} for t, y in rotten_tomatoes(limit=limit)]


def _take(rows: Iterable[dict], limit: int | None) -> list[dict]:
    out = []
    for r in rows:
        out.append(dict(r))
        if limit is not None and len(out) >= limit:
            break
    return out


def _json_cell(text: str, column: str, row: int) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ConfigError(f"column {column!r}, row {row}: {text!r} is not a JSON list") from None


def _csv_cell(value: Any) -> Any:
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (list, dict)) else value
