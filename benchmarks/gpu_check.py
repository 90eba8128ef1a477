"""The GPU check: the ``gpu``-marked tests and the suite on CUDA in bf16 at a realistic size.

    python benchmarks/gpu_check.py                  # 24 layers x 1024, batch 16 x 512, bf16
    python benchmarks/gpu_check.py --layers 4 --hidden 256 --batch 2 --seq 64 \
        --gen-layers 2 --gen-hidden 256 --gen-new 16                     # a smoke run

Runs, on a machine with a CUDA device, (1) ``pytest -m gpu`` (host-device syncs, device maps,
FSDP through accelerate, QLoRA), (2) ``benchmarks/run.py --device cuda --dtype bfloat16``
at the given size and (3) ``benchmarks/bench_generation.py --device cuda`` in the same dtype
(``HeadedModel.generate`` with a frozen lm_head and a value head ÷ the backbone's own
``generate``, tokens/s, and whether the greedy tokens are the same; default a 1.1B Llama
shape: 22 layers x 2048, 32 heads, 4 key-value heads, MLP 5632, batch 8, 128 new tokens),
then writes one JSON (``--out``, default ``benchmarks/results/gpu_check.json``): the machine
(GPU, torch, CUDA, transformers, peft, accelerate), the tests' counts, every scenario's
figures and the generation figures. Exit status 0 when the tests pass and every scenario
and the generation benchmark ran, 1 otherwise. Without CUDA it writes the JSON with
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
#: The generation benchmark's size options (``--gen-<name>``) and defaults: a 1.1B Llama.
GEN_SIZES = {
    "layers": 22,
    "hidden": 2048,
    "heads": 32,
    "kv_heads": 4,
    "intermediate": 5632,
    "batch": 8,
    "new": 128,
    "prompt": 32,
}
#: Its timing: fewer calls than the CPU default (each is seconds long at that size).
GEN_TIMING = {"warmup": 2, "steps": 10}


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
    ap.add_argument("--skip-suite", action="store_true", help="no suite run")
    ap.add_argument("--skip-generation", action="store_true", help="no generation benchmark")
    gen = ap.add_argument_group("the generation benchmark (benchmarks/bench_generation.py)")
    for name, default in {**GEN_SIZES, **GEN_TIMING}.items():
        flag = f"--gen-{name.replace('_', '-')}"
        gen.add_argument(flag, type=int, default=default, dest=f"gen_{name}")
    args = ap.parse_args(argv)
    for name in ("layers", "hidden", "batch", "seq", *(f"gen_{n}" for n in GEN_SIZES)):
        if getattr(args, name) < 1:
            flag = name.replace("gen_", "gen-").replace("_", "-")
            ap.error(f"--{flag} must be a positive integer, got {getattr(args, name)}")
    if args.gen_steps < 1 or args.gen_warmup < 0:
        ap.error(
            f"--gen-steps must be at least 1 and --gen-warmup at least 0, "
            f"got {args.gen_steps} and {args.gen_warmup}"
        )
    return args


def generation_size(args: argparse.Namespace) -> dict | None:
    """The generation benchmark's size, dtype and timing; None with --skip-generation."""
    if args.skip_generation:
        return None
    names = (*GEN_SIZES, *GEN_TIMING)
    return {**{n: getattr(args, f"gen_{n}") for n in names}, "dtype": args.dtype}


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


def run_generation(args: argparse.Namespace) -> dict:
    """``benchmarks/bench_generation.py --device cuda`` in the check's dtype; its result."""
    size = generation_size(args)
    assert size is not None
    with tempfile.TemporaryDirectory(prefix="headkit-gpu-check-") as tmp:
        out = Path(tmp, "generation.json")
        cmd = [sys.executable, str(HERE / "bench_generation.py"), "--device", "cuda"]
        cmd += ["--dtype", args.dtype]
        for name in (*GEN_SIZES, *GEN_TIMING):
            cmd += [f"--{name.replace('_', '-')}", str(size[name])]
        # the device machine is the check's own: no waiting for quiet CPUs, no reruns
        cmd += ["--retries", "0", "--quiet-timeout", "0", "--out", str(out)]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env())
        seconds = round(time.perf_counter() - start, 1)
        result = json.loads(out.read_text()) if out.is_file() else None
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    figures = {f["name"]: f["value"] for f in result.get("figures", [])} if result else {}
    details = result.get("details", {}) if result else {}
    return {
        "command": " ".join(["benchmarks/bench_generation.py", *cmd[2:-2]]),
        "returncode": proc.returncode,
        "seconds": seconds,
        "ok": proc.returncode == 0 and result is not None,
        "figures": figures,
        "same_tokens": details.get("same_tokens"),
        "first_different_token": details.get("first_different_token"),
        "result": result,
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
    record: dict = {"size": size, "generation_size": generation_size(args), "machine": machine()}
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
    if not args.skip_generation:
        record["generation"] = run_generation(args)
    ran = [record[k] for k in ("gpu_tests", "suite", "generation") if k in record]
    record["status"] = "passed" if all(r["ok"] for r in ran) else "failed"
    write(args.out, record)
    print(f"gpu_check: {record['status']} (wrote {args.out})")
    return 0 if record["status"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
