"""A mistyped column (or another bad argument) is reported before torch or transformers is
imported: one line, status 2, in a fraction of a second (no time is asserted: machines vary;
what is asserted is that the heavy imports never happened)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_RUN = (
    "import sys\n"
    "from headkit.cli.main import main\n"
    "rc = main(sys.argv[1:])\n"
    "heavy = sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules)\n"
    "print('HEAVY', rc, ','.join(heavy))\n"
)


def _run(args: list[str]) -> tuple[int, str, str]:
    done = subprocess.run(
        [sys.executable, "-c", _RUN, *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    line = next(x for x in done.stdout.splitlines() if x.startswith("HEAVY"))
    _, rc, heavy = (line.split(" ") + [""])[:3]
    return int(rc), heavy, done.stderr.strip()


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    data = tmp_path / "d.csv"
    data.write_text("text,label\na fine film,1\na dull film,0\n")
    config = tmp_path / "t.yaml"
    config.write_text(
        "model: packaged:minilm\nheads:\n  - {name: s, pred_for_sequence: true, num_outputs: 2}\n"
        "data: {train: d.csv, text_column: txet, label_columns: {s: label}}\noutput: out\n"
    )
    ckpt = tmp_path / "ckpt"  # what train leaves: the settings are read before the model
    ckpt.mkdir()
    settings = {"text_column": "txet", "label_columns": {"s": "label"}, "max_length": 32}
    (ckpt / "headkit_cli.json").write_text(json.dumps(settings))
    return {"data": data, "config": config, "ckpt": ckpt, "out": tmp_path / "o"}


@pytest.mark.parametrize(
    "command",
    [
        "probe --model packaged:minilm --data {data} --text-column txet --output {out}",
        "probe --model packaged:minilm --data {data} --text-column txet --output {out} --quiet "
        "--threads 1",
        "train {config}",
        "train {config} --quiet --threads 2",
        "eval {ckpt} --data {data}",
        "predict {ckpt} --data {data} --output {out}.csv",
    ],
)
def test_a_mistyped_column_is_reported_before_torch_is_imported(files, command):
    rc, heavy, err = _run(command.format(**files).split())
    assert rc == 2 and heavy == "", (heavy, err)
    assert "'txet': no such column" in err and "columns present: text, label" in err
    assert len(err.splitlines()) == 1


def test_threads_sets_torchs_thread_count_for_the_command_only():
    import torch

    from headkit.cli.main import _threads

    before = torch.get_num_threads()
    with _threads(1):
        assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    assert torch.get_num_threads() == before


def test_every_command_takes_threads_and_device():
    from headkit.cli.main import COMMANDS

    for name in COMMANDS:
        out = subprocess.run(
            [sys.executable, "-m", "headkit", name, "--help"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        ).stdout
        assert "--threads" in out and "--device DEVICE" in out, name


@pytest.mark.parametrize("command", ["convert", "export", "push"])
def test_device_says_what_it_is_for_where_no_data_runs_through_the_model(command, capsys):
    from headkit.cli.main import main

    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--device DEVICE where the checkpoint is loaded" in text
    assert "cpu (default), cuda, cuda:N, mps, or auto" in text


def test_device_is_checked_before_torch_and_against_what_torch_sees(files, capsys):
    from headkit.cli.main import main

    with pytest.raises(SystemExit) as e:  # the syntax, by argparse
        main(["eval", str(files["ckpt"]), "--data", str(files["data"]), "--device", "gpu"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --device: invalid value 'gpu'; allowed: cpu, cuda, cuda:N, mps" in err
    with pytest.raises(SystemExit) as e:  # on every command
        main(["convert", str(files["ckpt"]), str(files["out"]), "--device", "cuda:x"])
    assert e.value.code == 2 and "argument --device: invalid value 'cuda:x'" in (
        capsys.readouterr().err
    )
    args = ["probe", "--model", "packaged:minilm", "--data", str(files["data"])]
    args += ["--output", str(files["out"]), "--device", "cuda:999"]  # no machine has it
    assert main(args) == 2
    assert "--device='cuda:999': torch sees no such device here" in capsys.readouterr().err


def test_quiet_in_a_fresh_process_silences_transformers_then_sets_it_back(tmp_path):
    """``--quiet`` before transformers is imported: no bar, no load report on stderr; after
    the command, transformers' bars and verbosity are what they would have been."""
    from cli_helpers import review_files
    from conftest import build_tiny
    from tiny_text import tiny_tokenizer

    folder = tmp_path / "classifier"  # loaded as a bare backbone: transformers logs a report
    build_tiny("bert", num_layers=2, task="sequence-classification").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    data = review_files(tmp_path)["train"]
    script = (
        "import sys\n"
        "from headkit.cli.main import main\n"
        "rc = main(sys.argv[1:])\n"
        "from transformers.utils import logging\n"
        "print('AFTER', rc, logging.is_progress_bar_enabled(), logging.get_verbosity())\n"
    )
    args = ["probe", "--model", str(folder), "--data", str(data), "--layers", "0"]
    args += ["--val-splits", "1", "--output", str(tmp_path / "out"), "--quiet"]
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
    )
    assert "AFTER 0 True 30" in done.stdout, (done.stdout, done.stderr)  # 30: WARNING
    assert "LOAD REPORT" not in done.stderr and "Loading weights" not in done.stderr
    assert "Cannot enable progress bars" not in done.stderr
