"""Measuring ratios that survive a shared, noisy machine (see shared BENCHMARKING.md).

- ``ensure_bench_env``: glibc must keep freed memory (or page faults dominate small models),
  and idle OpenMP threads must sleep rather than spin (or other load on the machine
  multiplies step times); the variables are read at process start, so a process without
  them re-executes itself.
- ``measure``: warm-up, then the scenarios alternated step by step (A B, B A, ...), median of
  each; the whole measurement is rerun when other processes used more than ``max_load`` cores
  meanwhile (read from /proc/stat), keeping the least loaded attempt.
- ``peak_memory``: run in a fresh process per scenario; peak RSS above the RSS before.
- ``Goal`` and ``record``: every figure is a ratio with its goal, met or missed by how much.
- ``add_measure_args`` and ``Settings``: the options and defaults of every benchmark (the
  suite's and each ``bench_*.py``'s), ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "4294967296",
    "MALLOC_TRIM_THRESHOLD_": "4294967296",
    "MALLOC_TOP_PAD_": "536870912",
}
#: Waiting OpenMP threads sleep instead of spinning. On a shared, oversubscribed machine a
#: spinning thread burns the core its partner needs: a GPT-2 train step measured 630-1470 ms
#: with the default policy and 181-183 ms with PASSIVE at the same load (load average 5),
#: and the headkit/bare ratio of (a) moved 0.69-1.48 against 0.998-1.008.
OMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
BENCH_ENV = {**MALLOC_ENV, **OMP_ENV}
_REEXEC_MARK = "HEADKIT_BENCH_REEXEC"


def ensure_bench_env() -> None:
    """Re-execute this script with ``BENCH_ENV`` set where a variable is missing.

    Call before importing torch. glibc and OpenMP read these variables only at start, so
    setting them in ``os.environ`` would not do; ``os.execve`` replaces the process (same
    pid, same argv). A variable the caller set is kept as it is.
    """
    missing = {k: v for k, v in BENCH_ENV.items() if k not in os.environ}
    if not missing or os.environ.get(_REEXEC_MARK):
        return
    if not sys.argv or not sys.argv[0].endswith(".py"):
        # Not a script (a test calling main(), pytest-xdist's worker started by `python -c`):
        # re-executing would replace the caller's process with something else.
        return
    env = {**os.environ, **missing, _REEXEC_MARK: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def plain_malloc_env() -> dict[str, str]:
    """The environment without the malloc padding (for peak-memory processes: the padding
    keeps freed memory mapped, which would hide the peak of the scenario itself)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}


# ---------------------------------------------------------------------- load
def busy_seconds() -> float:
    """CPU seconds every process has spent busy so far (/proc/stat, all cores)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    t = os.times()
    return t.user + t.system


class LoadMeter:
    """``with LoadMeter() as m: ...`` → ``m.other_cores``: cores other processes used meanwhile."""

    def __enter__(self) -> LoadMeter:
        self._b, self._o, self._t = busy_seconds(), own_seconds(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._t
        others = (busy_seconds() - self._b) - (own_seconds() - self._o)
        self.other_cores = max(0.0, others) / max(self.wall, 1e-9)


def wait_for_quiet(max_load: float, timeout: float, window: float = 1.0) -> float:
    """Wait (up to ``timeout`` s) for a ``window`` in which others use at most ``max_load``
    cores; returns the seconds waited. On a shared machine this skips the busy spells."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        with LoadMeter() as m:
            time.sleep(window)
        if m.other_cores <= max_load:
            break
    return time.perf_counter() - t0


# ---------------------------------------------------------------------- timing
@dataclass
class Timing:
    """Medians (seconds) of alternated steps, and how loaded the machine was."""

    median: dict[str, float]
    samples: dict[str, list[float]]
    other_cores: float
    attempts: int
    loads: list[float] = field(default_factory=list)
    waited_s: float = 0.0
    cpu_samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def cpu_median(self) -> dict[str, float]:
        """This process's CPU seconds per step (all its threads), median of each side."""
        return {n: statistics.median(s) for n, s in self.cpu_samples.items()}

    def ratio(self, num: str, den: str) -> float:
        return self.median[num] / self.median[den]

    def cpu_ratio(self, num: str, den: str) -> float:
        """The ratio of the CPU-time medians: other processes' load hardly moves it on one
        thread (on several, waiting threads may spin)."""
        cpu = self.cpu_median
        return cpu[num] / cpu[den]

    def summary(self, tokens: int | None = None) -> dict[str, Any]:
        """ms per step for each side (and tokens/s when ``tokens`` per step is given)."""
        out: dict[str, Any] = {
            "ms": {n: round(v * 1e3, 3) for n, v in self.median.items()},
            "cpu_ms": {n: round(v * 1e3, 3) for n, v in self.cpu_median.items()},
            "spread_pct": {n: round(_spread(s) * 100, 1) for n, s in self.samples.items()},
            "steps": len(next(iter(self.samples.values()))),
            "other_cores": round(self.other_cores, 3),
            "attempts": self.attempts,
            "waited_for_quiet_s": round(self.waited_s, 1),
        }
        if tokens:
            out["tokens_per_s"] = {n: round(tokens / v, 1) for n, v in self.median.items()}
        return out


def _spread(samples: list[float]) -> float:
    """Interquartile range over the median: how steady one side's steps were."""
    if len(samples) < 4:
        return 0.0
    q = statistics.quantiles(samples, n=4)
    return (q[2] - q[0]) / statistics.median(samples)


def alternate(
    fns: Mapping[str, Callable[[], object]],
    warmup: int,
    steps: int,
    sync: Callable[[], None] = lambda: None,
    cpu: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Warm every side up, then time them alternated: A B C, C B A, A B C, ...

    Returns the wall seconds of each step per side; ``cpu``, when given, receives this
    process's CPU seconds of each step. Reversing the order every round gives each side
    the same neighbours on average. The garbage collector is off while timing (as in
    ``timeit``).
    """
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
            sync()
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu_times = cpu if cpu is not None else {}
    cpu_times.update({n: [] for n in names})
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(steps):
            for n in names if i % 2 == 0 else names[::-1]:
                c0, t0 = time.process_time(), time.perf_counter()
                fns[n]()
                sync()
                times[n].append(time.perf_counter() - t0)
                cpu_times[n].append(time.process_time() - c0)
    finally:
        if was_enabled:
            gc.enable()
    return times


def measure(
    fns: Mapping[str, Callable[[], object]],
    warmup: int,
    steps: int,
    max_load: float = 0.2,
    retries: int = 2,
    sync: Callable[[], None] = lambda: None,
    quiet_timeout: float = 0.0,
) -> Timing:
    """``alternate`` under a load check; reruns (up to ``retries`` times) when others used more
    than ``max_load`` cores, and keeps the least loaded attempt. Before each attempt it waits
    up to ``quiet_timeout`` seconds for the machine to be quiet."""
    best: Timing | None = None
    loads: list[float] = []
    waited = 0.0
    for attempt in range(1, retries + 2):
        if quiet_timeout > 0:
            waited += wait_for_quiet(max_load, quiet_timeout)
        cpu: dict[str, list[float]] = {}
        with LoadMeter() as m:
            samples = alternate(fns, warmup if attempt == 1 else warmup // 2, steps, sync, cpu)
        loads.append(m.other_cores)
        t = Timing(
            {n: statistics.median(s) for n, s in samples.items()},
            samples,
            m.other_cores,
            attempt,
            cpu_samples=cpu,
        )
        if best is None or t.other_cores < best.other_cores:
            best = t
        if m.other_cores <= max_load:
            break
    assert best is not None
    best.loads = [round(x, 3) for x in loads]
    best.waited_s = waited
    return best


# ---------------------------------------------------------------------- settings
@dataclass
class Settings:
    """How a benchmark measures: the suite's defaults, or a smoke run (``quick``)."""

    warmup: int = 5
    steps: int = 20
    max_load: float = 0.2
    retries: int = 2
    quiet_timeout: float = 30.0
    threads: int = 2
    quick: bool = False

    def measure(
        self,
        fns: Mapping[str, Callable[[], object]],
        warmup: int | None = None,
        steps: int | None = None,
        sync: Callable[[], None] = lambda: None,
    ) -> Timing:
        """``measure`` with these settings (``warmup``/``steps`` override them for sides
        too long to repeat 20 times)."""
        return measure(
            fns,
            self.warmup if warmup is None else warmup,
            self.steps if steps is None else steps,
            self.max_load,
            self.retries,
            sync,
            self.quiet_timeout,
        )

    def as_dict(self) -> dict[str, Any]:
        """The settings, and whether the allocator and OpenMP ran as BENCHMARKING.md says."""
        return {
            **asdict(self),
            "malloc_env": all(os.environ.get(k) == v for k, v in MALLOC_ENV.items()),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
        }


def add_measure_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options every benchmark takes (defaults: ``Settings``; ``--quick``: a smoke run
    with 1 warm-up step, 3 timed steps, no reruns and no waiting for a quiet machine)."""
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few steps (smoke test)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (5; quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (20; quick 3)")
    ap.add_argument("--max-load", type=float, default=0.2, help="other cores before a rerun")
    ap.add_argument("--retries", type=int, default=None, help="reruns of a loaded timing (2)")
    ap.add_argument(
        "--quiet-timeout",
        type=float,
        default=None,
        help="seconds to wait for a quiet machine before each timing (default 30, quick 0)",
    )
    return ap


def settings_of(args: argparse.Namespace) -> Settings:
    """``Settings`` from the options of ``add_measure_args``."""
    q = bool(args.quick)

    def pick(value: Any, quick: Any, full: Any) -> Any:
        return value if value is not None else (quick if q else full)

    return Settings(
        warmup=pick(args.warmup, 1, 5),
        steps=pick(args.steps, 3, 20),
        max_load=args.max_load,
        retries=pick(args.retries, 0, 2),
        quiet_timeout=pick(args.quiet_timeout, 0.0, 30.0),
        threads=args.threads,
        quick=q,
    )


# ---------------------------------------------------------------------- memory
def status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter of this process (VmHWM); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_now_mib() -> dict[str, float | None]:
    """This process's RSS and peak RSS (VmRSS, VmHWM), MiB.

    Not ``ru_maxrss``: it also holds the peak of threads that exited and, after exec, the RSS
    of the process this one was forked from (the whole suite), so it is neither resettable
    nor this process's own peak.
    """
    rss, hwm = status_kib("VmRSS"), status_kib("VmHWM")
    return {
        "rss_mib": None if rss is None else rss / 1024,
        "peak_mib": None if hwm is None else hwm / 1024,
    }


def peak_memory(fn: Callable[[], object], repeats: int = 2) -> dict[str, Any]:
    """Run ``fn`` ``repeats`` times and report the peak RSS above the RSS just before (MiB).

    The peak counter is reset first (``/proc/self/clear_refs``), so what building the model
    touched does not count; where that is refused the increment is left to the caller
    (the peak of this process minus that of a process that only built the model).
    """
    gc.collect()
    reset = reset_peak_rss()
    before = rss_now_mib()
    for _ in range(repeats):
        fn()
    after = rss_now_mib()
    ok = reset and before["rss_mib"] is not None and after["peak_mib"] is not None
    return {
        "rss_before_mib": before["rss_mib"],
        "peak_mib": after["peak_mib"],
        "peak_reset": reset,
        "increment_mib": after["peak_mib"] - before["rss_mib"] if ok else None,
    }


# ---------------------------------------------------------------------- records
_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": lambda x, v: x <= v,
    "<": lambda x, v: x < v,
    ">=": lambda x, v: x >= v,
    ">": lambda x, v: x > v,
}


@dataclass(frozen=True)
class Goal:
    """``figure <op> value``, e.g. Goal("<=", 1.05); op is one of <=, <, >=, >."""

    op: str
    value: float

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"Goal op={self.op!r} is unknown; allowed: {', '.join(_OPS)}")

    def met(self, ratio: float) -> bool:
        return _OPS[self.op](ratio, self.value)

    def __str__(self) -> str:
        return f"{self.op} {self.value:g}"


def record(
    scenario: str,
    name: str,
    arch: str,
    figure: str,
    ratio: float | None,
    goal: Goal | None = None,
    details: dict[str, Any] | None = None,
    status: str = "ok",
    note: str = "",
) -> dict[str, Any]:
    """One result: ``{scenario, name, arch, figure, ratio, goal, met, missed_by, status, ...}``.

    ``status``: "ok" (measured), "n/a" (cannot be measured yet: ``note`` says why), "failed"
    (the thing measured does not work yet: ``note`` says how), "error" (the benchmark broke).
    ``missed_by`` is how far over the goal the ratio is, relative to the goal (0.03 = 3 %).
    """
    met = missed = None
    if goal is not None and ratio is not None and status == "ok":
        met = goal.met(ratio)
        missed = None if met else round(abs(ratio / goal.value - 1), 4)
    elif goal is not None and status == "failed":
        met = False
    return {
        "scenario": scenario,
        "name": name,
        "arch": arch,
        "figure": figure,
        "ratio": None if ratio is None else round(ratio, 4),
        "goal": None if goal is None else str(goal),
        "met": met,
        "missed_by": missed,
        "status": status,
        "note": note,
        "details": details or {},
    }
