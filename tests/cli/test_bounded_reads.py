"""The command line's reads are bounded while they happen: a FIFO or a device stops at
``--limit`` or at the first overlong line, wide tables and huge cells are refused without
being read whole, and option ranges are checked before any work."""

from __future__ import annotations

import os
import threading

import pytest
from cli_helpers import one_error_line, review_files, tiny_model, train_checkpoint

from headkit import ConfigError
from headkit.cli.datafiles import MAX_COLUMNS, MAX_FIELD, read_rows
from headkit.cli.main import main

pytestmark = pytest.mark.usefixtures("single_thread")


def _endless_writer(fifo, line: bytes, header: bytes = b"") -> threading.Thread:
    """A thread writing ``header`` then ``line`` into ``fifo`` for ever, until the reader
    closes its end."""

    def write() -> None:
        with open(fifo, "wb", buffering=0) as f:
            try:
                f.write(header)
                while True:
                    f.write(line)
            except (BrokenPipeError, ConnectionResetError):
                return

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    "suffix, header, line",
    [
        (".csv", b"text,label\n", b"good film,pos\n"),
        (".jsonl", b"", b'{"text": "good film", "label": "pos"}\n'),
    ],
)
def test_a_fifo_with_limit_stops_at_the_limit(tmp_path, suffix, header, line):
    fifo = tmp_path / f"data{suffix}"
    os.mkfifo(fifo)
    writer = _endless_writer(fifo, line, header)
    rows = read_rows(fifo, limit=3)
    assert rows == [{"text": "good film", "label": "pos"}] * 3
    writer.join(timeout=30)
    assert not writer.is_alive()  # the writer saw the reader close: the read stopped


def test_a_fifo_of_one_endless_line_is_refused_while_reading(tmp_path):
    fifo = tmp_path / "data.csv"
    os.mkfifo(fifo)
    writer = _endless_writer(fifo, b"x" * 65536)
    with pytest.raises(ConfigError, match=f"line 1 is longer than {MAX_FIELD} characters"):
        read_rows(fifo, limit=3)
    writer.join(timeout=30)
    assert not writer.is_alive()


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_dev_zero_behind_a_data_file_name_is_refused(tmp_path, capsys, suffix):
    link = tmp_path / f"zero{suffix}"
    link.symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match="line 1 is longer than"):
        read_rows(link, limit=2)
    model = tiny_model(tmp_path)
    code = main(
        [
            "probe",
            "--model",
            str(model),
            "--data",
            str(link),
            "--limit",
            "2",
            "--output",
            str(tmp_path / "out"),
        ]
    )
    assert "longer than" in one_error_line(code, capsys.readouterr().err)


def test_a_table_of_too_many_columns_is_refused_at_its_header(tmp_path):
    wide = tmp_path / "wide.csv"
    names = [f"c{i}" for i in range(MAX_COLUMNS + 1)]
    wide.write_text(",".join(names) + "\n" + ",".join("1" for _ in names) + "\n")
    with pytest.raises(ConfigError, match=f"the header has {MAX_COLUMNS + 1} columns; at most"):
        read_rows(wide)
    jsonl = tmp_path / "wide.jsonl"
    jsonl.write_text("{" + ",".join(f'"{n}": 1' for n in names) + "}\n")
    with pytest.raises(ConfigError, match=f"line 1 has {MAX_COLUMNS + 1} columns"):
        read_rows(jsonl)


def test_a_huge_text_cell_is_refused_while_reading_not_read_whole(tmp_path, capsys):
    big = tmp_path / "big.csv"
    big.write_text('text\n"' + "a" * (MAX_FIELD + 10) + '"\nshort\n')
    with pytest.raises(ConfigError, match=f"longer than {MAX_FIELD} characters"):
        read_rows(big)
    model = tiny_model(tmp_path)
    reviews = review_files(tmp_path, n=40)
    ckpt = train_checkpoint(tmp_path, model, reviews["train"])
    capsys.readouterr()
    code = main(["predict", str(ckpt), "--data", str(big), "--output", str(tmp_path / "p.csv")])
    assert f"longer than {MAX_FIELD} characters" in one_error_line(code, capsys.readouterr().err)
    # eval with a label column for a target no head has: one line naming the heads
    args = ["eval", str(ckpt), "--data", str(reviews["test"]), "--label-column", "nohead=label"]
    line = one_error_line(main(args), capsys.readouterr().err)
    assert "--label-column nohead=label: no head has target 'nohead'" in line
    assert "sentiment (target sentiment)" in line


@pytest.mark.parametrize(
    "flag, value, allowed",
    [
        ("--val-splits", "1000000", "an integer from 1 to 100"),
        ("--val-splits", "0", "an integer from 1 to 100"),
        ("--seed", str(10**21), "an integer from 0 to 4294967295"),
        ("--seed", "-1", "an integer from 0 to 4294967295"),
    ],
)
def test_probe_option_ranges_are_checked_before_any_work(tmp_path, capsys, flag, value, allowed):
    args = [
        "probe",
        "--model",
        "packaged:minilm",
        "--data",
        "packaged:rotten_tomatoes",
        "--output",
        str(tmp_path / "o"),
        flag,
        value,
    ]
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and allowed in err and len(err) < 2000
