"""Tables of examples for the command line: read them, check their columns, write predictions.

Readable: CSV (``.csv``, ``.tsv``), JSON Lines (``.jsonl``, ``.ndjson``), JSON (``.json``, a list
of objects), Parquet (``.parquet``, ``.pq``; needs pyarrow), a folder written by a
``datasets`` ``save_to_disk`` (needs datasets), and ``packaged:rotten_tomatoes`` (the packaged
review snippets: columns ``text``, ``label``), ``packaged:presidential_debates`` (sentences of
the 2016 US presidential and vice-presidential debates: ``text``, ``label`` = the speaker, 9
classes), ``packaged:convention_speeches`` (sentences of the 2012 US party conventions'
speeches: ``label`` = the party). CSV cells are strings; ``as_number`` and ``as_class`` turn
label cells into numbers where they look like numbers.

Text files are read as UTF-8, or by their byte-order mark (UTF-8, UTF-16, UTF-32), or in the
``encoding`` given; a byte that does not decode is reported with its offset and the
``--encoding`` option. A BOM never reaches the first column's name, and a malformed file (a CSV
row with more or fewer fields than the header, JSON nested deeper than Python can read, a
corrupt Parquet file) is one ``ConfigError`` naming the file and the row.

Reads are bounded while they happen, so a pipe, a FIFO or a device stops: a file is opened once
and read in one pass (a regular file is also checked to decode to its end first), ``limit``
rows end the read, a line or CSV field longer than ``MAX_FIELD`` characters is refused while it
is read (never read whole), a table of more than ``MAX_COLUMNS`` columns is refused at its
header, and a ``.json`` file (read whole: it is one value) may hold at most ``MAX_JSON_BYTES``
(use JSON Lines for more).
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import io
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..packaged import CORPORA

FORMATS = (
    "CSV (.csv, .tsv), JSON Lines (.jsonl, .ndjson), JSON (.json), Parquet (.parquet, .pq), "
    "a datasets.save_to_disk folder, or packaged:rotten_tomatoes"
)
PACKAGED_DATA = tuple(f"packaged:{name}" for name in CORPORA)
#: Bytes decoded at a time while checking a file's encoding.
_CHUNK = 1 << 20
#: Longest CSV field or JSON Lines line (characters): refused while it is read.
MAX_FIELD = 1 << 22
#: Most columns of a table (a header of more is refused before any row is read).
MAX_COLUMNS = 10_000
#: Largest ``.json`` data file (bytes; JSON Lines has no such limit).
MAX_JSON_BYTES = 1 << 28
#: Row numbers named in one error (the rest are counted).
_NAMED_ROWS = 10


def read_rows(
    source: str | os.PathLike, limit: int | None = None, encoding: str | None = None
) -> list[dict[str, Any]]:
    """The rows of a data file as dicts (at most ``limit``); text files are decoded with
    ``encoding`` (default: from the byte-order mark, else UTF-8)."""
    name = str(source)
    if name.startswith("packaged:"):
        return _packaged(name, limit)
    path = Path(source)
    if not path.exists():
        raise ConfigError(
            f"data file {name!r} does not exist; allowed: {FORMATS}", field="data", value=name
        )
    suffix = path.suffix.lower()
    if path.is_dir():
        rows = _datasets_dir(path, limit)
    elif suffix in (".csv", ".tsv", ".jsonl", ".ndjson", ".json"):
        rows = _text_rows(path, suffix, limit, encoding)
    elif suffix in (".parquet", ".pq"):
        rows = _parquet(path, limit)
    else:
        raise ConfigError(
            f"data file {name!r}: unknown format {suffix!r}; allowed: {FORMATS}",
            field="data",
            value=name,
        )
    if not rows:
        raise ConfigError(f"data file {name!r} holds no rows", field="data", value=name)
    return rows


def _text_rows(
    path: Path, suffix: str, limit: int | None, encoding: str | None
) -> list[dict[str, Any]]:
    """Rows of a CSV, TSV, JSON Lines or JSON file, read in one bounded pass (see the module
    docstring). A bad byte is reported with its offset: found while reading, or before it
    when only ``limit`` rows of a regular file are read (the whole file must still decode)."""
    regular = path.is_file()
    with open(path, "rb") as raw:
        buffered = io.BufferedReader(raw) if not isinstance(raw, io.BufferedReader) else raw
        codec, how = _codec(buffered.peek(4)[:4], encoding)
        if limit is not None and regular:
            _check_decodes(path, codec, how)
        text = io.TextIOWrapper(buffered, encoding=codec, newline="")
        try:
            if suffix in (".csv", ".tsv"):
                return _csv(path, text, "\t" if suffix == ".tsv" else ",", limit)
            if suffix == ".json":
                return _json(path, text, limit)
            return _jsonl(path, text, limit)
        except UnicodeDecodeError as e:
            if regular:
                _check_decodes(path, codec, how)  # raises, naming the first bad byte
            raise ConfigError(
                f"data file {str(path)!r} does not decode ({how}): {e.reason}; name its "
                "encoding with --encoding, e.g. --encoding latin-1"
            ) from None
        finally:
            text.detach()


def _lines(path: Path, f: Any) -> Iterator[str]:
    """The lines of a text stream, each read with a bound: a line longer than MAX_FIELD
    characters is refused while it is read."""
    number = 0
    while True:
        line = f.readline(MAX_FIELD + 1)
        if not line:
            return
        number += 1
        if len(line) > MAX_FIELD and not line.endswith("\n"):
            raise ConfigError(
                f"data file {str(path)!r}: line {number} is longer than {MAX_FIELD} characters "
                "(MAX_FIELD), refused while reading; shorten or split that text (only the "
                "first --max-length tokens of a text are used)"
            )
        yield line


def text_encoding(path: Path, encoding: str | None = None) -> tuple[str, str]:
    """(the codec ``path`` decodes with, how it was chosen): ``encoding`` if given, else its
    byte-order mark's, else UTF-8."""
    with open(path, "rb") as f:
        head = f.read(4)
    return _codec(head, encoding)


def _codec(head: bytes, encoding: str | None) -> tuple[str, str]:
    """``text_encoding`` from the first (up to) 4 bytes of a file."""
    if encoding is not None:
        try:
            codec = codecs.lookup(encoding).name
        except LookupError:
            raise ConfigError(
                f"--encoding={encoding!r} is not a known text encoding; e.g. utf-8, utf-16, "
                "latin-1, cp1252"
            ) from None
        if codec == "utf-8" and head.startswith(codecs.BOM_UTF8):
            codec = "utf-8-sig"  # the mark is not text
        how = f"--encoding={encoding}"
    else:
        codec = _bom_codec(head)
        how = "read as UTF-8: no byte-order mark" if codec == "utf-8" else f"read as {codec}"
    return codec, how


def _bom_codec(head: bytes) -> str:
    if head.startswith(codecs.BOM_UTF8):
        return "utf-8-sig"
    if head.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):
        return "utf-32"  # before UTF-16: the UTF-32 LE mark starts with UTF-16 LE's
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "utf-16"
    return "utf-8"


def _check_decodes(path: Path, codec: str, how: str) -> None:
    decoder = codecs.getincrementaldecoder(codec)()
    done = 0  # bytes fed to the decoder so far
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                at = done - pending + e.start
                bad = e.object[e.start : e.start + 4]
                raise ConfigError(
                    f"data file {str(path)!r}: byte {at} ({bad!r}) does not decode ({how}); "
                    "name the file's encoding with --encoding, e.g. --encoding latin-1 or "
                    "--encoding cp1252",
                    field="data",
                    value=str(path),
                ) from None
            if not chunk:
                return
            done += len(chunk)


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


def require_labels(
    rows: Sequence[Mapping[str, Any]], wanted: Mapping[str, str], source: str
) -> None:
    """Raise ConfigError naming the option, the column and the row numbers (0-based) of empty
    label cells (missing, blank text or NaN): an empty cell is no class, and no value."""
    for option, column in wanted.items():
        empty = [i for i, r in enumerate(rows) if _empty(r.get(column))]
        if empty:
            shown = ", ".join(map(str, empty[:_NAMED_ROWS]))
            more = f" and {len(empty) - _NAMED_ROWS} more" if len(empty) > _NAMED_ROWS else ""
            raise ConfigError(
                f"{option}={column!r}: {len(empty)} row(s) of {source} have an empty label "
                f"(rows {shown}{more}, counted from 0); fill them in or remove those rows"
            )


def _empty(cell: Any) -> bool:
    if cell is None:
        return True
    if isinstance(cell, str):
        return not cell.strip()
    return isinstance(cell, float) and math.isnan(cell)


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
    """Write rows as CSV (``.csv``/``.tsv``; list cells as JSON) or JSON Lines (``.jsonl``),
    atomically (``outputs.write_file``: a fresh exclusive name, then renamed)."""
    from .outputs import write_file

    out = Path(path)
    suffix = out.suffix.lower()
    if suffix not in OUTPUT_SUFFIXES:
        raise ConfigError(
            f"--output={str(path)!r}: unknown format {suffix!r}; allowed: .csv, .tsv, .jsonl"
        )
    return write_file(out, lambda f: write_table(f, rows, suffix))


#: Suffixes ``write_rows`` writes.
OUTPUT_SUFFIXES = (".csv", ".tsv", ".jsonl", ".ndjson")


def write_table(f: Any, rows: Sequence[Mapping[str, Any]], suffix: str = ".csv") -> None:
    """Rows to an open text stream as CSV, TSV or JSON Lines (by ``suffix``)."""
    if suffix in (".jsonl", ".ndjson"):
        for r in rows:
            f.write(json.dumps(dict(r), ensure_ascii=False) + "\n")
        return
    writer = csv.DictWriter(
        f, fieldnames=columns_of(rows), delimiter="\t" if suffix == ".tsv" else ","
    )
    writer.writeheader()
    for r in rows:
        writer.writerow({k: _csv_cell(v) for k, v in r.items()})


# ---------------------------------------------------------------------- readers
@contextlib.contextmanager
def _field_size() -> Iterator[None]:
    """CSV fields of up to MAX_FIELD characters while reading (the csv module's limit is
    process-wide: it is put back on the way out)."""
    before = csv.field_size_limit(MAX_FIELD)
    try:
        yield
    finally:
        csv.field_size_limit(before)


def _check_columns(path: Path, count: int, where: str) -> None:
    if count > MAX_COLUMNS:
        raise ConfigError(
            f"data file {str(path)!r}: {where} has {count} columns; at most {MAX_COLUMNS} "
            "(MAX_COLUMNS)"
        )


def _csv(path: Path, f: Any, delimiter: str, limit: int | None) -> list[dict]:
    rows: list[dict] = []
    with _field_size():
        reader = csv.reader(_lines(path, f), delimiter=delimiter, strict=True)
        try:
            header = next(reader, None)
            if header is None:
                return rows
            _check_columns(path, len(header), "the header")
            header[0] = header[0].removeprefix("\ufeff")  # a BOM the codec did not take
            seen: set[str] = set()
            twice = sorted({c for c in header if c in seen or seen.add(c)})
            if twice:
                shown = [c[:40] for c in twice[:_NAMED_ROWS]]
                raise ConfigError(f"{path}: the header names column(s) {shown} more than once")
            for cells in reader:
                if not cells:
                    continue  # a blank line
                if len(cells) != len(header):
                    names = ", ".join(h[:40] for h in header[:20])
                    more = f" and {len(header) - 20} more" if len(header) > 20 else ""
                    raise ConfigError(
                        f"{path}: row {len(rows)} (line {reader.line_num}) has {len(cells)} "
                        f"fields but the header has {len(header)} ({names}{more}); quote "
                        "fields that hold the delimiter"
                    )
                rows.append(dict(zip(header, cells)))
                if limit is not None and len(rows) >= limit:
                    break
        except csv.Error as e:
            why = str(e)
            if "field larger than field limit" in why:
                why = f"a field longer than {MAX_FIELD} characters (MAX_FIELD)"
            raise ConfigError(f"{path}: line {reader.line_num} is not valid CSV ({why})") from None
    return rows


def _jsonl(path: Path, f: Any, limit: int | None) -> list[dict]:
    rows = []
    for i, line in enumerate(_lines(path, f)):
        if not line.strip():
            continue
        row = _parse_json(line, f"{path}: line {i + 1}")
        if not isinstance(row, dict):
            raise ConfigError(f"{path}: line {i + 1} is not a JSON object")
        _check_columns(path, len(row), f"line {i + 1}")
        rows.append(row)
        if limit is not None and len(rows) >= limit:
            break
    return rows


def _json(path: Path, f: Any, limit: int | None) -> list[dict]:
    text = f.read(MAX_JSON_BYTES + 1)
    if len(text) > MAX_JSON_BYTES:
        raise ConfigError(
            f"data file {str(path)!r}: a .json file larger than {MAX_JSON_BYTES} characters "
            "(MAX_JSON_BYTES; it is read whole); write it as JSON Lines (.jsonl), one object "
            "per line"
        )
    data = _parse_json(text, f"{path}")
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ConfigError(f"{path}: a .json data file must hold a list of objects")
    for i, row in enumerate(data[:limit] if limit is not None else data):
        _check_columns(path, len(row), f"object {i}")
    return data[:limit] if limit is not None else data


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not valid JSON ({e})") from None
    except RecursionError:
        raise ConfigError(
            f"{where}: JSON nested deeper than Python's recursion limit; flatten the data"
        ) from None


def _parquet(path: Path, limit: int | None) -> list[dict]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"{path}: reading Parquet needs pyarrow: pip install pyarrow (or headkit[data])"
        ) from None
    try:
        parquet = pq.ParquetFile(path)
        _check_columns(path, len(parquet.schema_arrow.names), "the schema")
        rows: list[dict] = []
        for batch in parquet.iter_batches(batch_size=1024):  # stops at limit
            rows.extend(batch.to_pylist())
            if limit is not None and len(rows) >= limit:
                return rows[:limit]
        return rows
    except (pa.ArrowException, OSError, ValueError) as e:
        message = " ".join(str(e).split())
        raise ConfigError(f"{path}: not a readable Parquet file ({message})") from None


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
    _check_columns(path, len(data.column_names), "the dataset")
    if limit is not None:
        data = data.select(range(min(limit, len(data))))
    return data.to_list()


def _packaged(name: str, limit: int | None) -> list[dict]:
    if name not in PACKAGED_DATA:
        raise ConfigError(
            f"data={name!r} is unknown; allowed: {', '.join(PACKAGED_DATA)}",
            field="data",
            value=name,
        )
    corpus = CORPORA[name.removeprefix("packaged:")]
    return [{"text": t, "label": y} for t, y in corpus(limit=limit)]


def _json_cell(text: str, column: str, row: int) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ConfigError(f"column {column!r}, row {row}: {text!r} is not a JSON list") from None


def _csv_cell(value: Any) -> Any:
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (list, dict)) else value
