"""The benchmark suite and every other benchmark run and follow one results contract
(benchmarks/README.md). No timing is asserted: machines vary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
FIGURE_KEYS = {"name", "value", "unit", "goal", "met"}


@pytest.fixture
def bench_modules() -> Iterator[None]:
    """benchmarks/ importable (as run.py makes it), and torch's thread count restored after
    (the benchmarks set their own)."""
    threads = torch.get_num_threads()
    sys.path.insert(0, str(BENCH))
    try:
        yield
    finally:
        sys.path.remove(str(BENCH))
        torch.set_num_threads(threads)


def test_quick_suite_writes_records(tmp_path: Path, bench_modules: None) -> None:
    import run

    out, doc = tmp_path / "results.json", tmp_path / "benchmarks.md"
    argv = ["--quick", "--only", "a,b", "--threads", "1", "--out", str(out), "--doc", str(doc)]
    assert run.main(argv) == 0
    results = json.loads(out.read_text())
    names = {(r["name"], r["arch"]) for r in results["records"]}
    for arch in ("gpt2", "llama", "bert"):
        assert {("a_overhead_frozen", arch), ("a_overhead_trainable", arch)} <= names
        assert ("b_early_exit", arch) in names
    for r in results["records"]:
        assert r["status"] == "ok", r
        assert r["ratio"] > 0 and r["goal"] and isinstance(r["met"], bool)
        assert r["details"]["ms"] and r["details"]["steps"] == 3
        assert set(r["details"]["cpu_ms"]) == set(r["details"]["ms"])
    # without --with-others the recorded results of the other benchmarks are shown
    recorded = {o["name"] for o in results["others"]}
    assert recorded == {p.stem.removeprefix("bench_") for p in BENCH.glob("bench_*.py")}
    assert not results["errors"]
    text = doc.read_text()
    assert "| scenario | arch | ratio | goal | met? | notes |" in text
    assert text.count("| a: ") == 6 and text.count("| b: ") == 3
    assert "| benchmark | figure | value | unit | goal | met? | source |" in text


def test_scripts_reexecute_with_the_bench_env(tmp_path: Path) -> None:
    """A benchmark run as a script re-executes itself with the malloc settings of shared
    BENCHMARKING.md and OMP_WAIT_POLICY=PASSIVE (read only at process start); a variable
    the caller set is kept."""
    script = tmp_path / "show_env.py"
    script.write_text(
        f"import json, os, sys\nsys.path.insert(0, {str(BENCH)!r})\n"
        "from _harness import BENCH_ENV, ensure_bench_env\nensure_bench_env()\n"
        "print(json.dumps({k: os.environ.get(k) for k in BENCH_ENV}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "OMP_WAIT"))}
    env["MALLOC_TOP_PAD_"] = "1024"
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {
        "MALLOC_MMAP_THRESHOLD_": "4294967296",
        "MALLOC_TRIM_THRESHOLD_": "4294967296",
        "MALLOC_TOP_PAD_": "1024",
        "OMP_WAIT_POLICY": "PASSIVE",
    }


def test_every_benchmark_follows_the_contract(tmp_path: Path, bench_modules: None) -> None:
    """What run.py --quick --with-others does: each bench_*.py's main(["--quick", ...,
    "--out", ...]) returns the contract's dict and writes the same dict."""
    from _report import check_result, collect_others

    out_dir = tmp_path / "results"
    ran, errors = collect_others(BENCH, True, ["--quick", "--threads", "1"], out_dir)
    assert not errors
    scripts = sorted(p.stem.removeprefix("bench_") for p in BENCH.glob("bench_*.py"))
    assert [o["name"] for o in ran] == scripts
    for o in ran:
        assert o["source"] == f"ran bench_{o['name']}.py now (--quick)"
        written = json.loads((out_dir / f"{o['name']}.json").read_text())
        assert check_result(written, o["name"]) == []
        assert written["name"] == o["name"] and written["settings"]["quick"] is True
        assert written["figures"] == o["figures"]
        for f in o["figures"]:
            assert set(f) == FIGURE_KEYS
            assert (f["goal"] is None) == (f["met"] is None)
    # every script's recorded result in benchmarks/results/ follows the contract too
    for name in scripts:
        recorded = json.loads((BENCH / "results" / f"{name}.json").read_text())
        assert check_result(recorded, name) == [], name


def test_reader_refuses_what_breaks_the_contract(tmp_path: Path, bench_modules: None) -> None:
    from _report import collect_others

    (tmp_path / "results").mkdir()
    fig = {"name": "tokens/s", "value": 1234.5, "unit": "tokens/s", "goal": None, "met": None}
    good = {"name": "gen", "settings": {}, "figures": [fig]}
    (tmp_path / "results" / "gen.json").write_text(json.dumps(good))
    legacy = {"setting": {"ratio": 2.0}, "last_over_peft": 1.16}  # no figures: not guessed at
    (tmp_path / "results" / "lora.json").write_text(json.dumps(legacy))
    met_without_goal = {**good, "name": "odd", "figures": [{**fig, "met": True}]}
    (tmp_path / "results" / "odd.json").write_text(json.dumps(met_without_goal))
    (tmp_path / "results" / "renamed.json").write_text(json.dumps(good))
    recorded, errors = collect_others(tmp_path, run=False)
    assert [o["name"] for o in recorded] == ["gen"]
    assert recorded[0]["figures"] == [fig] and "recorded in" in recorded[0]["source"]
    assert len(errors) == 3
    assert any("lora.json" in e and "'figures'" in e for e in errors)
    assert any("odd.json" in e and "met=True without a goal" in e for e in errors)
    assert any("renamed.json" in e and "'name' is 'gen'" in e for e in errors)

    (tmp_path / "bench_bad.py").write_text("def main(argv=None):\n    return {'name': 'bad'}\n")
    ran, errors = collect_others(tmp_path, run=True)
    assert any(e.startswith("bench_bad.py: main() broke the contract") for e in errors)
    assert "bad" not in {o["name"] for o in ran}


def test_figures_and_goals(bench_modules: None) -> None:
    from _harness import Goal
    from _report import figure

    assert figure("r", 0.96, "ratio", Goal(">=", 0.95))["met"] is True
    assert figure("r", 1.2, "ratio", Goal("<=", 1.1)) == {
        "name": "r",
        "value": 1.2,
        "unit": "ratio",
        "goal": "<= 1.1",
        "met": False,
    }
    assert figure("mib", 7.0, "MiB") == {
        "name": "mib",
        "value": 7.0,
        "unit": "MiB",
        "goal": None,
        "met": None,
    }
    with pytest.raises(ValueError, match="op='=='"):
        Goal("==", 1.0)


def test_generation_in_another_dtype_and_size(tmp_path: Path, bench_modules: None) -> None:
    """bench_generation.py's --dtype and size options (the GPU check runs it with --device
    cuda at a 1.1B Llama shape): the backbone in bfloat16, grouped-query attention, and the
    greedy tokens compared with the backbone's own in that dtype."""
    import bench_generation

    out = tmp_path / "generation.json"
    argv = ["--quick", "--threads", "1", "--dtype", "bfloat16", "--out", str(out)]
    argv += ["--heads", "2", "--kv-heads", "1", "--intermediate", "96", "--new", "6"]
    result = bench_generation.main(argv)
    assert json.loads(out.read_text()) == result
    assert result["settings"]["device"] == "cpu" and result["settings"]["dtype"] == "bfloat16"
    model = result["settings"]["model"]
    assert (model["hidden"], model["heads"], model["kv_heads"]) == (64, 2, 1)
    assert (model["intermediate"], model["new"], model["batch"]) == (96, 6, 2)
    details = result["details"]
    assert isinstance(details["same_tokens"], bool)
    assert (details["first_different_token"] is None) == details["same_tokens"]
    assert result["figures"][0]["goal"] == ">= 0.97"


def test_generation_refuses_a_size_below_one(
    capsys: pytest.CaptureFixture[str], bench_modules: None
) -> None:
    import bench_generation

    with pytest.raises(SystemExit) as exit_:
        bench_generation.main(["--quick", "--kv-heads", "0"])
    assert exit_.value.code == 2
    assert "--kv-heads must be a positive integer, got 0" in capsys.readouterr().err
