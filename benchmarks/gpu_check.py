"""The GPU check: the ``gpu``-marked tests and the suite on CUDA in bf16 at a realistic size.

    python benchmarks/gpu_check.py                  # 24 layers x 1024, batch 16 x 512, bf16
    python benchmarks/gpu_check.py --layers 4 --hidden 256 --batch 2 --seq 64   # a smoke run

Runs, on a machine with a CUDA device, (1) ``pytest -m gpu`` (host-device syncs, device maps,
FSDP through accelerate, QLoRA) and (2) ``benchmarks/run.py --device cuda --dtype bfloat16``
at the given size, then writes one JSON (``--out``, default
``benchmarks/results/gpu_check.json``): the machine (GPU, torch, CUDA, transformers, peft,
accelerate), the tests' counts and every scenario's figures. Exit status 0 when the tests
pass and every scenario ran, 1 otherwise. Without CUDA it writes the JSON with
``"status": "skipped"`` and the reason, says so on stderr and exits 3 (nothing was checked).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: Exit status when there is no CUDA device: nothing was checked.
NO_CUDA = 3
PACKAGES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "safetensors")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24, help="blocks of each suite model")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size of each suite model")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--only", default="abcdefghi", help="the suite's scenario letters")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "gpu_check.json")
    ap.add_argument("--skip-tests", action="store_true", help="the suite only")
    ap.add_argument("--skip-suite", action="store_true", help="the gpu-marked tests only")
    args = ap.parse_args(argv)
    for name in ("layers", "hidden", "batch", "seq"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be a positive integer, got {getattr(args, name)}")
    return args


def machine() -> dict:
    """The GPU and the versions that ran the check."""
    import torch

    facts: dict = {"python": platform.python_version(), "cuda_available": False}
    for name in PACKAGES:
        try:
            facts[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            facts[name] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(
            cuda_available=True,
            cuda=torch.version.cuda,
            gpu=props.name,
            gpu_count=torch.cuda.device_count(),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            bf16_supported=torch.cuda.is_bf16_supported(),
        )
    return facts


def run_gpu_tests() -> dict:
    """``pytest -m gpu`` in a child process; its counts from the JUnit report."""
    with tempfile.TemporaryDirectory(prefix="headkit-gpu-check-") as tmp:
        report = Path(tmp, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-m", "gpu", "-rs"]
        cmd += [f"--junitxml={report}"]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env())
        seconds = round(time.perf_counter() - start, 1)
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if report.is_file():
            suite = ET.parse(report).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            counts = {k: int(suite.get(k, 0)) for k in counts}
    tail = proc.stdout.strip().splitlines()[-15:]
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    ok = proc.returncode == 0 and counts["tests"] > 0
    return {
        "command": " ".join(cmd[1:]),
        "returncode": proc.returncode,
        "passed": passed,
        **counts,
        "seconds": seconds,
        "ok": ok,
        "output_tail": tail,
    }


def run_suite(args: argparse.Namespace) -> dict:
    """``benchmarks/run.py`` on CUDA at the given size; its results JSON."""
    with tempfile.TemporaryDirectory(prefix="headkit-gpu-check-") as tmp:
        out = Path(tmp, "results.json")
        cmd = [sys.executable, str(HERE / "run.py"), "--device", "cuda", "--dtype", args.dtype]
        cmd += ["--layers", str(args.layers), "--hidden", str(args.hidden)]
        cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--only", args.only]
        cmd += ["--out", str(out), "--no-doc"]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env())
        seconds = round(time.perf_counter() - start, 1)
        results = json.loads(out.read_text()) if out.is_file() else None
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {
        "command": " ".join(["benchmarks/run.py", *cmd[2:-3]]),
        "returncode": proc.returncode,
        "seconds": seconds,
        "ok": proc.returncode == 0 and results is not None,
        "results": results,
        "output_tail": tail,
    }


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1"}


def write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    size = {k: getattr(args, k) for k in ("layers", "hidden", "batch", "seq", "dtype")}
    record: dict = {"size": size, "machine": machine()}
    if not record["machine"]["cuda_available"]:
        record |= {"status": "skipped", "reason": "torch sees no CUDA device"}
        write(args.out, record)
        print(
            f"gpu_check: skipped, torch sees no CUDA device; nothing was checked "
            f"(wrote {args.out}, exit {NO_CUDA})",
            file=sys.stderr,
        )
        return NO_CUDA
    if not args.skip_tests:
        record["gpu_tests"] = run_gpu_tests()
    if not args.skip_suite:
        record["suite"] = run_suite(args)
    ran = [record[k] for k in ("gpu_tests", "suite") if k in record]
    record["status"] = "passed" if all(r["ok"] for r in ran) else "failed"
    write(args.out, record)
    print(f"gpu_check: {record['status']} (wrote {args.out})")
    return 0 if record["status"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
