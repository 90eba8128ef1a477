"""Results of the suite: other benchmarks' figures, ``results.json`` and ``docs/benchmarks.md``.

The contract for other benchmarks (see benchmarks/README.md): a module
``benchmarks/bench_<name>.py`` exposes ``main(argv: list[str] | None = None) -> dict`` and
its recorded result lives in ``benchmarks/results/<name>.json``; both are the dict that
``bench_result`` builds, ``{"name": <name>, "figures": [figure, ...], "settings", ...}``,
each figure made by ``figure``. ``check_result`` says what breaks the contract; a result
that breaks it is an error of the suite, not guessed at.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _harness import MALLOC_ENV, Goal

NOTES_START = "<!-- notes: kept by benchmarks/run.py when it rewrites this file -->"
NOTES_END = "<!-- end of notes -->"
FIGURE_KEYS = ("name", "value", "unit", "goal", "met")
FORMAT_VERSION = 1


# ---------------------------------------------------------------------- the contract
def figure(name: str, value: float, unit: str, goal: Goal | None = None) -> dict[str, Any]:
    """One figure of a benchmark: ``{"name", "value", "unit", "goal", "met"}``."""
    value = float(value)
    return {
        "name": name,
        "value": round(value, 4) if abs(value) >= 1e-3 else float(f"{value:.4g}"),
        "unit": unit,
        "goal": None if goal is None else str(goal),
        "met": None if goal is None else goal.met(value),
    }


def bench_result(
    name: str,
    figures: list[dict[str, Any]],
    settings: dict[str, Any],
    details: dict[str, Any] | None = None,
    threads: int = 2,
    device: str = "cpu",
) -> dict[str, Any]:
    """A benchmark's result: its figures, how it was measured (``settings``: sizes, steps,
    ``quick``), the machine and command, and ``details`` (absolute times, checks)."""
    result = {
        "name": name,
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": command_line(),
        "machine": machine_facts(threads, device),
        "settings": settings,
        "figures": figures,
        "details": details or {},
    }
    problems = check_result(result, name)
    if problems:
        raise ValueError(f"bench_{name}: the result breaks the contract: {'; '.join(problems)}")
    return result


def write_result(result: dict[str, Any], out: Path | None) -> None:
    """Write ``result`` as JSON to ``out`` (atomically: a reader never sees half a file)."""
    if out is None:
        return
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, out)


def publish(result: dict[str, Any], out: Path | None, markdown: str | None = None) -> dict:
    """Write ``result`` to ``out`` (and ``markdown``, a report, beside it as .md), print its
    figures on one line, and return it: the end of every ``bench_*.py``'s ``main``."""
    write_result(result, out)
    if markdown is not None and out is not None:
        Path(out).with_suffix(".md").write_text(markdown)
    figures = "; ".join(f"{f['name']} = {f['value']}" for f in result["figures"])
    print(f"{result['name']}: {figures}")
    return result


def check_result(result: Any, name: str | None = None) -> list[str]:
    """What in ``result`` breaks the contract (empty: it follows it)."""
    if not isinstance(result, dict):
        return [f"a result is a dict, got {type(result).__name__}"]
    problems = []
    if not isinstance(result.get("name"), str) or not result.get("name"):
        problems.append(f"'name' must be a non-empty string, got {result.get('name')!r}")
    elif name is not None and result["name"] != name:
        problems.append(f"'name' is {result['name']!r}; the file names {name!r}")
    figs = result.get("figures")
    if not isinstance(figs, list) or not figs:
        return [*problems, f"'figures' must be a non-empty list, got {figs!r:.80}"]
    for i, f in enumerate(figs):
        where = f"figures[{i}]"
        if not isinstance(f, dict) or set(f) != set(FIGURE_KEYS):
            problems.append(f"{where} must have exactly the keys {FIGURE_KEYS}, got {f!r:.120}")
            continue
        if not isinstance(f["name"], str) or not f["name"]:
            problems.append(f"{where}.name must be a non-empty string")
        v = f["value"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            problems.append(f"{where}.value must be a finite number, got {v!r}")
        if not isinstance(f["unit"], str) or not f["unit"]:
            problems.append(f"{where}.unit must be a non-empty string, got {f['unit']!r}")
        if f["goal"] is None:
            if f["met"] is not None:
                problems.append(f"{where}: met={f['met']!r} without a goal")
        elif not isinstance(f["goal"], str) or not isinstance(f["met"], bool):
            problems.append(f"{where}: a goal is a string and met a bool, got {f!r:.120}")
    if not isinstance(result.get("settings"), dict):
        problems.append("'settings' must be a dict (how it was measured)")
    return problems


def collect_others(
    bench_dir: Path, run: bool, argv: list[str] | None = None, out_dir: Path | None = None
) -> tuple[list[dict], list[str]]:
    """Figures of the other benchmarks: with ``run``, each ``bench_*.py``'s ``main(argv)``
    (``--out out_dir/<name>.json`` added when ``out_dir`` is given); the results recorded in
    ``bench_dir/results/*.json`` of the benchmarks not run. Returns (benchmarks, errors)."""
    found: dict[str, dict] = {}
    errors: list[str] = []
    if run:
        for path in sorted(bench_dir.glob("bench_*.py")):
            name = path.stem.removeprefix("bench_")
            args = list(argv or [])
            if out_dir is not None:
                args += ["--out", str(out_dir / f"{name}.json")]
            try:
                spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
                mod = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = mod  # dataclasses look their module up there
                spec.loader.exec_module(mod)
                result = mod.main(args)
            except Exception as e:
                errors.append(f"{path.name}: {type(e).__name__}: {e}")
                continue
            problems = check_result(result, name)
            if problems:
                errors.append(f"{path.name}: main() broke the contract: {'; '.join(problems)}")
                continue
            found[name] = {**result, "source": f"ran {path.name} now"}
    for path in sorted((bench_dir / "results").glob("*.json")):
        if path.stem in found or (run and (bench_dir / f"bench_{path.stem}.py").exists()):
            continue  # ran now (or broke now: its error says so, not an older figure)
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            errors.append(f"{path}: unreadable ({e})")
            continue
        problems = check_result(result, path.stem)
        if problems:
            errors.append(f"{path}: breaks the contract: {'; '.join(problems)}")
            continue
        found[path.stem] = {**result, "source": f"recorded in benchmarks/results/{path.name}"}
    others = []
    for n, r in sorted(found.items()):
        quick = bool(r.get("settings", {}).get("quick"))
        others.append(
            {
                "name": n,
                "source": r["source"] + (" (--quick)" if quick else ""),
                "created": r.get("created"),
                "figures": [{k: f[k] for k in FIGURE_KEYS} for f in r["figures"]],
            }
        )
    return others, errors


# ---------------------------------------------------------------------- machine
def machine_facts(threads: int, device: str) -> dict[str, Any]:
    import torch
    import transformers

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    facts = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "malloc_env": all(k in os.environ for k in MALLOC_ENV),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
        "device": device,
    }
    if device == "cuda":
        facts["gpu"] = torch.cuda.get_device_name()
    try:
        root = Path(__file__).resolve().parent.parent
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
        facts["commit"] = commit + ("+changes" if dirty else "")
    except OSError:
        pass
    return facts


# ---------------------------------------------------------------------- markdown
def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _met(r: dict) -> str:
    if r["status"] == "n/a":
        return "n/a"
    if r["status"] == "error":
        return "error"
    if r["met"] is None:
        return ""
    if r["met"]:
        return "yes"
    return f"**no** (+{r['missed_by'] * 100:.1f} %)" if r.get("missed_by") else "**no**"


def _notes(r: dict) -> str:
    d = r["details"]
    parts = []
    ms = d.get("ms")
    if ms and r["scenario"] not in "bf":
        parts.append(", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()))
    s = r["scenario"]
    if s == "b" and "probe_k_over_floor_k" in d:
        parts.append(
            f"ideal {d['ideal']:.3f}; ÷ {d['k']}-block floor {d['probe_k_over_floor_k']:.2f}; "
            f"last layer ÷ bare {d['probe_last_over_bare_full']:.2f}; all-states predecessor "
            f"÷ floor {d['all_states_k_over_floor_k']:.2f}"
        )
    if s == "e" and "loss_masking_share" in d:
        parts.append(
            f"loss masking alone {d['loss_masking_share']:.3f}, attention padding mask alone "
            f"{d['backbone_masking_share']:.3f}; {d['pad_fraction'] * 100:.0f} % pads"
        )
    if s == "f" and "cache_pass_s" in d:
        parts.append(
            f"through the backbone {d['through_s']:.2f} s (step {ms['step']:.1f} ms); cache pass "
            f"{d['cache_pass_s']:.2f} s ({d['cache_pass_over_epoch']:.2f} epoch) + training "
            f"{d['cached_training_s']:.2f} s; {d['sequences']} sequences"
        )
    if s == "g" and "increment_mib" in d:
        inc = d["increment_mib"]
        parts.append(
            f"MiB above the built model: head {_fmt(inc['headed_mid'], 0)}, all states "
            f"{_fmt(inc['bare_all_states'], 0)}, bare {_fmt(inc['bare'], 0)} ({d['batch']})"
        )
    if s == "h" and "layer_2_on_over_off" in d:
        parts.append(f"probe on layer 2: {d['layer_2_on_over_off']:.3f}")
    if s == "i":
        if "bare_compile_s" in d:
            parts.append(
                f"compile: headkit {d['headkit_compile_s']:.0f} s, bare {d['bare_compile_s']:.0f} s"
            )
        if "graph_breaks" in d:
            parts.append(f"{d['graph_breaks']} graph breaks")
    if r.get("note"):
        parts.append(r["note"][:300])
    oc = d.get("other_cores")
    if oc is not None:
        parts.append(f"load {oc:.2f} cores" + (" (noisy)" if oc > 0.2 else ""))
    return "; ".join(parts).replace("|", "\\|")


def markdown(results: dict, previous: str | None) -> str:
    m, st = results["machine"], results["settings"]
    lines = [
        "# Benchmarks",
        "",
        "<!-- generated by benchmarks/run.py; only the notes section at the end is kept -->",
        "",
    ]
    if results.get("note"):
        lines += [f"**{results['note']}**", ""]
    lines += [
        "Every figure is a ratio measured inside one process: headkit's cost over its floor or "
        "peer, the two sides alternated step by step, median of each side "
        f"({st['steps']} timed steps after {st['warmup']} warm-up; a scenario is rerun up to "
        f"{st['retries']} times when other processes used more than {st['max_load']} cores). "
        "See benchmarks/README.md for what each scenario compares.",
        "",
        "Command: "
        + "; then ".join(f"`{c}`" for c in results.get("commands") or [results["command"]])
        + (
            " (with --merge: each record's measured_at says which run)"
            if len(results.get("commands") or []) > 1
            else ""
        ),
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads, device "
        f"{m['device']}{' (' + m['gpu'] + ')' if m.get('gpu') else ''}; Python {m['python']}, "
        f"torch {m['torch']}, transformers {m['transformers']}; malloc env vars: "
        f"{m['malloc_env']}; OMP_WAIT_POLICY {m.get('omp_wait_policy', '?')}; "
        f"commit {m.get('commit', '?')}; {results['created']}.",
        "",
        f"Models: random {', '.join(st['archs'])} built from configs, {st['layers']} layers, "
        f"hidden {st['hidden']}, {st['dtype']}; batch {st['batch']} x {st['seq']} tokens.",
        "",
        "| scenario | arch | ratio | goal | met? | notes |",
        "|---|---|---:|---|---|---|",
    ]
    for r in results["records"]:
        lines.append(
            f"| {r['scenario']}: {r['figure']} | {r['arch']} | {_fmt(r['ratio'])} | "
            f"{r['goal'] or ''} | {_met(r)} | {_notes(r)} |"
        )
    thr = [r for r in results["records"] if r["details"].get("tokens_per_s")]
    if thr:
        lines += [
            "",
            "## Absolute throughput (tokens/s per side)",
            "",
            "| scenario | arch | sides |",
            "|---|---|---|",
        ]
        for r in thr:
            sides = ", ".join(f"{k} {v:,.0f}" for k, v in r["details"]["tokens_per_s"].items())
            lines.append(f"| {r['name']} | {r['arch']} | {sides} |")
    others = results.get("others") or []
    if others:
        lines += [
            "",
            "## Other benchmarks",
            "",
            "| benchmark | figure | value | unit | goal | met? | source |",
            "|---|---|---:|---|---|---|---|",
        ]
        for o in others:
            source = o["source"] + (f", {o['created']}" if o.get("created") else "")
            for f in o["figures"]:
                met = "" if f["met"] is None else ("yes" if f["met"] else "**no**")
                name = f["name"].replace("|", "\\|")
                lines.append(
                    f"| {o['name']} | {name} | {f['value']:.4g} | {f['unit']} "
                    f"| {f['goal'] or ''} | {met} | {source} |"
                )
    if results.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e}" for e in results["errors"]]
    notes = ""
    if previous and NOTES_START in previous and NOTES_END in previous:
        notes = previous.split(NOTES_START, 1)[1].split(NOTES_END, 1)[0].strip("\n")
    lines += ["", NOTES_START, notes, NOTES_END, ""]
    return "\n".join(lines)


def write(results: dict, out: Path, doc: Path | None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    if doc is not None:
        previous = doc.read_text() if doc.exists() else None
        doc.parent.mkdir(parents=True, exist_ok=True)
        doc.write_text(markdown(results, previous))


def command_line() -> str:
    """How this run was started (relative script path; a --note's text is elided)."""
    argv = list(sys.argv[1:])
    for i, a in enumerate(argv[:-1]):
        if a == "--note":
            argv[i + 1] = "…"
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):  # outside the working directory: keep it absolute
        script = script.relative_to(Path.cwd())
    return shlex.join(["python", script.as_posix(), *argv])
