"""benchmarks/gpu_check.py on a machine without CUDA: its arguments and the skipped record.

The check itself (``pytest -m gpu`` and the suite in bf16 on CUDA) needs a GPU; here it
must say clearly that nothing was checked, in its JSON and its exit status.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))

import gpu_check  # noqa: E402


def test_the_defaults_are_the_realistic_size():
    args = gpu_check.parse_args([])
    assert (args.layers, args.hidden, args.batch, args.seq) == (24, 1024, 16, 512)
    assert args.dtype == "bfloat16"
    assert args.out == ROOT / "benchmarks" / "results" / "gpu_check.json"


def test_sizes_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_check.parse_args(["--layers", "0"])
    assert exit_.value.code == 2
    assert "--layers must be a positive integer, got 0" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_it_writes_a_skipped_record_and_exits_3(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--layers", "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == gpu_check.NO_CUDA == 3
    assert "gpu_check: skipped, torch sees no CUDA device; nothing was checked" in proc.stderr
    record = json.loads(out.read_text())
    assert record["status"] == "skipped"
    assert record["reason"] == "torch sees no CUDA device"
    assert record["size"] == {
        "layers": 2,
        "hidden": 1024,
        "batch": 16,
        "seq": 512,
        "dtype": "bfloat16",
    }
    assert record["machine"]["cuda_available"] is False
    assert record["machine"]["torch"] == metadata.version("torch")
    assert "gpu_tests" not in record and "suite" not in record and "generation" not in record


def test_the_generation_benchmark_defaults_to_a_1b_llama_in_the_check_dtype():
    args = gpu_check.parse_args(["--dtype", "float16"])
    assert gpu_check.generation_size(args) == {
        "layers": 22,
        "hidden": 2048,
        "heads": 32,
        "kv_heads": 4,
        "intermediate": 5632,
        "batch": 8,
        "new": 128,
        "prompt": 32,
        "warmup": 2,
        "steps": 10,
        "dtype": "float16",
    }
    assert gpu_check.generation_size(gpu_check.parse_args(["--skip-generation"])) is None


def test_generation_sizes_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_check.parse_args(["--gen-kv-heads", "0"])
    assert exit_.value.code == 2
    assert "--gen-kv-heads must be a positive integer, got 0" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
@pytest.mark.parametrize("skip", [False, True], ids=["generation", "skip-generation"])
def test_without_cuda_the_record_names_the_generation_size(tmp_path, skip):
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--gen-layers", "4"]
    cmd += ["--gen-new", "16", *(["--skip-generation"] if skip else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == gpu_check.NO_CUDA
    record = json.loads(out.read_text())
    assert record["status"] == "skipped" and "generation" not in record
    if skip:
        assert record["generation_size"] is None
    else:
        size = record["generation_size"]
        assert (size["layers"], size["new"], size["hidden"]) == (4, 16, 2048)
        assert size["dtype"] == "bfloat16"
