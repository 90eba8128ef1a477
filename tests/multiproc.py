"""The one harness for tests that need several processes: ranks of a process group, and
forked children.

Ranks (parent side) — run ``python WORKER OUT_DIR *ARGS`` once per rank on CPU over gloo::

    launch = start_ranks(WORKER, out_dir, launcher="torchrun", nprocs=2, args=["4"])
    ...                                  # work in this process while the ranks run
    reports = launch.reports()           # [rank 0's report, rank 1's report]
    reports = run_ranks(WORKER, out_dir)  # start and wait in one call

``launcher`` is "python" (one fresh interpreter, no process group: a reload in a new
process), "torchrun" (``python -m torch.distributed.run --standalone``) or
"accelerate" (``accelerate launch --multi_gpu``: without GPUs, CPU ranks over gloo;
``--cpu`` cannot be combined with ``--multi_gpu``). Both pick a free port themselves. Every
rank gets ``OMP_NUM_THREADS=1``, ``HF_HUB_OFFLINE=1`` and the repository and ``tests/`` on
``PYTHONPATH`` (so a worker imports ``conftest.build_tiny`` and this module). ``reports()``
waits at most ``timeout`` seconds (then kills every process of the launch) and fails the
test with the end of the launch's output when it times out, exits non-zero or a rank wrote
no report. Later multi-process tests (feature caching across ranks, FSDP2) reuse this.

Ranks (worker side) — the script ``WORKER``::

    from multiproc import run_rank

    def main(out: Path, *args: str) -> dict:  # this rank's report, JSON-able
        ...

    if __name__ == "__main__":
        run_rank(main)

``run_rank`` runs ``main`` on one thread, writes ``OUT_DIR/rank<r>.json``, then waits for
every rank (barrier) and destroys the process group (when one was initialised, by
accelerate, Trainer or ``init_process_group()``): a rank that exits while its peer's gloo
threads still talk to it makes the peer abort (SIGABRT) at shutdown. ``rank()`` gives this
process's rank (0 when not launched as a rank) for naming the worker's own files.

Forked children — plain concurrent processes with no process group, started in
milliseconds because they inherit this process's imports (Linux)::

    child = fork(target, *args, log=tmp_path / "child.log")  # a started Process
    child.join(); child.exitcode

The child runs on one thread (a forked OpenMP pool must not be used), with its stdout and
stderr in ``log`` (or discarded), and leaves with ``os._exit`` so nothing of pytest runs in
it; an exception in ``target`` is printed there and makes the exit code 1.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
LAUNCHERS = ("python", "torchrun", "accelerate")


def rank() -> int:
    """This process's rank in its launch (0 when it was not launched as a rank)."""
    return int(os.environ.get("RANK", "0"))


def _env() -> dict[str, str]:
    path = [str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(p for p in path if p),
    }


def _command(launcher: str, nprocs: int) -> list[str]:
    if launcher == "python":  # one fresh process, no process group (a reload elsewhere)
        if nprocs != 1:
            raise ValueError(f"launcher='python' starts one process; nprocs={nprocs} is invalid")
        return [sys.executable]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone"] + [
            f"--nproc_per_node={nprocs}"
        ]
    if launcher == "accelerate":
        exe = shutil.which("accelerate", path=str(Path(sys.executable).parent))
        if exe is None:
            pytest.skip("the accelerate command is not installed next to this Python")
        return [exe, "launch", "--multi_gpu", f"--num_processes={nprocs}", "--num_machines=1"] + [
            "--mixed_precision=no",
            "--dynamo_backend=no",
            "--main_process_port=0",
        ]
    raise ValueError(f"launcher={launcher!r} is unknown; allowed: {', '.join(LAUNCHERS)}")


class Launch:
    """A running launch of ``nprocs`` ranks; ``reports()`` waits for it."""

    def __init__(self, proc: subprocess.Popen, out: Path, nprocs: int, timeout: float) -> None:
        self.proc, self.out, self.nprocs, self.timeout = proc, out, nprocs, timeout

    def _kill(self) -> None:
        """Kill the launcher and every rank it started (its own process group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def reports(self) -> list[dict[str, Any]]:
        """Each rank's report, in rank order; fails the test with the launch's output if it
        timed out, exited non-zero or left a rank without a report."""
        try:
            stdout, stderr = self.proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self._kill()
            stdout, stderr = self.proc.communicate()
            pytest.fail(
                f"the launch ran over {self.timeout} s:\n{stdout[-2000:]}\n{stderr[-4000:]}"
            )
        finally:
            self._kill()
        files = [self.out / f"rank{r}.json" for r in range(self.nprocs)]
        if self.proc.returncode != 0 or not all(f.is_file() for f in files):
            pytest.fail(
                f"the launch exited with {self.proc.returncode}, reports "
                f"{[f.name for f in files if f.is_file()]}:\n{stdout[-2000:]}\n{stderr[-4000:]}"
            )
        return [json.loads(f.read_text()) for f in files]


def start_ranks(
    worker: Path,
    out: Path,
    *,
    launcher: str = "torchrun",
    nprocs: int = 2,
    args: Sequence[str] = (),
    timeout: float = 300.0,
) -> Launch:
    """Start ``worker`` on ``nprocs`` CPU ranks under ``launcher``; each writes into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [*_command(launcher, nprocs), str(worker), str(out), *map(str, args)]
    proc = subprocess.Popen(
        cmd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a time-out kills the ranks too
    )
    return Launch(proc, out, nprocs, timeout)


def run_ranks(worker: Path, out: Path, **kwargs: Any) -> list[dict[str, Any]]:
    """``start_ranks(...).reports()``: launch and wait."""
    return start_ranks(worker, out, **kwargs).reports()


def run_rank(main: Callable[..., dict[str, Any]]) -> None:
    """Worker side: ``main(OUT_DIR, *args)`` from the command line, its report written to
    ``OUT_DIR/rank<r>.json``, then every rank leaves together."""
    import torch

    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    report = main(out, *sys.argv[2:])
    (out / f"rank{rank()}.json").write_text(json.dumps(report))
    finish()


def finish() -> None:
    """Barrier, then destroy the process group, if one was initialised."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _forked(target: Callable[..., Any], args: tuple, log: Path | None) -> None:
    import torch

    code = 0
    try:
        # Never the parent's fds 1 and 2: under pytest-xdist they may carry its channel.
        fd = os.open(log or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        torch.set_num_threads(1)
        target(*args)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def fork(target: Callable[..., Any], *args: Any, log: Path | None = None):
    """Start ``target(*args)`` in a forked child (Linux), its output in ``log`` (discarded
    when None); returns the started ``multiprocessing.Process``."""
    context = multiprocessing.get_context("fork")
    child = context.Process(target=_forked, args=(target, args, log), daemon=True)
    child.start()
    return child
