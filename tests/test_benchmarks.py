"""The benchmark suite runs and writes its records (no timing is asserted: CI machines vary)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def test_quick_suite_writes_records(tmp_path: Path) -> None:
    out, doc = tmp_path / "results.json", tmp_path / "benchmarks.md"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env = {k: v for k, v in env.items() if not k.startswith(("MALLOC_", "OMP_WAIT"))}
    cmd = [sys.executable, str(BENCH / "run.py"), "--quick", "--only", "a,b"]
    cmd += ["--out", str(out), "--doc", str(doc)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    results = json.loads(out.read_text())
    names = {(r["name"], r["arch"]) for r in results["records"]}
    for arch in ("gpt2", "llama", "bert"):
        assert {("a_overhead_frozen", arch), ("a_overhead_trainable", arch)} <= names
        assert ("b_early_exit", arch) in names
    for r in results["records"]:
        assert r["status"] == "ok", r
        assert r["ratio"] > 0 and r["goal"] and isinstance(r["met"], bool)
        assert r["details"]["ms"] and r["details"]["steps"] == 3
    # run.py re-executed itself with the malloc and OpenMP settings
    assert results["machine"]["malloc_env"] and results["machine"]["omp_wait_policy"] == "PASSIVE"
    text = doc.read_text()
    assert "| scenario | arch | ratio | goal | met? | notes |" in text
    assert text.count("| a: ") == 6 and text.count("| b: ") == 3


def test_other_benchmarks_contract(tmp_path: Path) -> None:
    """bench_*.py main() results and recorded results/*.json with "figures" are collected."""
    sys.path.insert(0, str(BENCH))
    try:
        from _report import collect_others
    finally:
        sys.path.remove(str(BENCH))
    (tmp_path / "results").mkdir()
    fig = {"name": "tokens/s", "value": 1234.5, "unit": "tokens/s", "goal": None, "met": None}
    (tmp_path / "bench_gen.py").write_text(
        f"def main(argv=None):\n    return {{'name': 'generation', 'figures': [{fig!r}]}}\n"
    )
    old = {"name": "generation", "figures": [{**fig, "value": 1000.0}]}
    (tmp_path / "results" / "generation.json").write_text(json.dumps(old))
    (tmp_path / "results" / "sweep.json").write_text(
        json.dumps({"name": "sweep", "figures": [{**fig, "name": "layers/s", "met": True}]})
    )
    legacy = {"setting": {"ratio": 2.0}, "last_over_peft": 1.16, "median_ms": {"peft": 8.3}}
    legacy |= {"goals": {"last_over_peft": 1.05}, "goals_met": {"last_over_peft": False}}
    (tmp_path / "results" / "lora.json").write_text(json.dumps(legacy))
    recorded, errors = collect_others(tmp_path, run=False)
    assert not errors
    assert [o["name"] for o in recorded] == ["generation", "lora", "sweep"]
    lora = next(o for o in recorded if o["name"] == "lora")  # no "figures": derived
    assert lora["figures"] == [
        {"name": "last_over_peft", "value": 1.16, "unit": "ratio", "goal": "1.05", "met": False}
    ]
    assert next(o for o in recorded if o["name"] == "generation")["figures"][0]["value"] == 1000
    ran, errors = collect_others(tmp_path, run=True)
    assert not errors
    gen = next(o for o in ran if o["name"] == "generation")  # what main() returned now
    assert gen["source"].startswith("ran bench_gen.py") and gen["figures"] == [fig]
