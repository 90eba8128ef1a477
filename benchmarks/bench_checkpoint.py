"""What does saving and reloading a probe on SmolLM2-135M cost, next to loading the backbone?

Setting: the packaged SmolLM2-135M-Instruct (GGUF, dequantised to fp32 on load: 134.5M
parameters), one sequence probe (2 classes, mean pooling, layer 15), 2 threads. The backbone
is frozen and unchanged, so each save writes only the probe (~5 KB) and a reference to the
backbone; a reload loads the backbone through transformers and then the probe.

Measured in one process by the suite's harness (``_harness``: warm-up, the sides alternated
A B, B A, ..., medians, rerun when other processes loaded the machine):
  hf_load        AutoModel.from_pretrained(smollm2_path(), gguf_file=SMOLLM2_GGUF)
  headkit_load   HeadedModel.from_pretrained(checkpoint)  (backbone + fingerprint + probe)
  save           model.save_pretrained(checkpoint)        (probe + reference + fingerprint)
  overhead       what headkit adds to a reload besides transformers' loading: reading and
                 verifying the checkpoint and the heads, and describing the source
  fingerprint    the backbone fingerprint alone, as this headkit computes it, and as the
                 previous one did (sums of every tensor), where this headkit still has it
Figures: headkit_load ÷ hf_load (goal <= 1.1); (hf_load + headkit's own part) ÷ hf_load.

``--before PATH`` runs the same scenario with the headkit of another checkout (e.g.
``git archive c846a8c headkit | tar -x -C /tmp/headkit-base``) in a child process, since
only one headkit can be imported per process. ``--quick``: a tiny random Llama saved to a
temporary folder instead of SmolLM2 (a smoke test).

Run (writes benchmarks/results/checkpoint.json):
  HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/bench_checkpoint.py --before /tmp/headkit-base
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from _harness import (
    MALLOC_ENV,
    Goal,
    Settings,
    add_measure_args,
    ensure_bench_env,
    settings_of,
)
from _report import bench_result, figure, publish

HERE = Path(__file__).resolve().parent
NAME = "checkpoint"
GOAL = Goal("<=", 1.1)


def _backbone(quick: bool, tmp: Path) -> tuple[str, dict[str, str], int]:
    """(folder, from_pretrained keywords, probe layer): SmolLM2, or a tiny saved Llama."""
    if not quick:
        from headkit.packaged import SMOLLM2_GGUF, smollm2_path

        return str(smollm2_path()), {"gguf_file": SMOLLM2_GGUF}, 15
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=256,
        num_attention_heads=1,
        num_key_value_heads=1,
        vocab_size=1000,
    )
    LlamaModel(cfg).save_pretrained(tmp / "tiny")
    return str(tmp / "tiny"), {}, 1


def scenario(st: Settings, repeats: int, saves: int) -> dict[str, Any]:
    """Measure with whichever headkit is importable; the medians (s) and sizes."""
    from transformers import AutoModel

    from headkit import HeadConfig, HeadedModel, load_headed

    source_of = _source_of()
    torch.set_num_threads(st.threads)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path, kw, layer = _backbone(st.quick, Path(tmp))
        probe = HeadConfig(
            "probe", num_outputs=2, pred_for_sequence=True, pooling="mean", layer_hook=layer
        )

        def hf_load():
            return AutoModel.from_pretrained(path, trust_remote_code=False, **kw)

        model = load_headed(path, head_configs=[probe], **kw)
        with torch.no_grad():
            for p in model.heads.parameters():
                p.add_(0.5)
            expected = model.eval()(ids).preds_by_head["probe"]
        ckpt = Path(tmp) / "probe"
        save = st.measure({"save": lambda: model.save_pretrained(ckpt)}, 1, saves)
        out["checkpoint_bytes"] = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
        manifest = json.loads((ckpt / "head_configs.json").read_text())
        out["backbone_entry_kind"] = manifest["backbone"]["kind"]
        held: dict[str, Any] = {}

        def headkit_load():
            held["loaded"] = HeadedModel.from_pretrained(ckpt)

        loads = st.measure({"hf_load": hf_load, "headkit_load": headkit_load}, 1, repeats)
        with torch.no_grad():
            if not torch.equal(held.pop("loaded").eval()(ids).preds_by_head["probe"], expected):
                raise RuntimeError("the reloaded probe predicts differently")
        backbone = hf_load()
        parts = {"checkpoint": lambda: load_headed(backbone, head_folder_path=ckpt)}
        if source_of is not None:
            parts["source"] = lambda: source_of(backbone, path, None, kw)
        overhead = st.measure(parts, 1, saves)
        fingerprints = _fingerprints(st, model, path, kw, saves)
    out["save"] = save.summary()
    out["load"] = loads.summary()
    out["overhead"] = overhead.summary()
    out["load_ratio"] = loads.ratio("headkit_load", "hf_load")
    hf_s = loads.median["hf_load"]
    extra = sum(overhead.median.values())  # reading the checkpoint (+ the source)
    out["load_ratio_from_overhead"] = (hf_s + extra) / hf_s
    out["save_ms"] = save.median["save"] * 1e3
    if fingerprints is not None:
        out["fingerprint"] = fingerprints.summary()
        out["fingerprint_over_previous"] = fingerprints.ratio(
            "files_fingerprint", "previous_fingerprint"
        )
    return out


def _source_of():
    """headkit's ``source_of`` (where the backbone came from, with its fingerprint), in this
    layout or an earlier one (a --before checkout); None where it has none."""
    import importlib

    for module in ("headkit.backbone.sources", "headkit.sources", "headkit.source"):
        try:
            return importlib.import_module(module).source_of
        except (ImportError, AttributeError):
            continue
    return None  # a headkit from before checkpoints referenced their backbone


def _fingerprints(st: Settings, model, folder: str, kwargs: dict, steps: int):
    """This headkit's fingerprint work vs the previous one's, alternated on one backbone
    (None where this headkit has no previous fingerprint to compare with)."""
    try:
        from headkit.backbone.fingerprint import legacy_fingerprint
        from headkit.backbone.sources import model_fingerprint
    except ImportError:
        return None
    src = model.source
    return st.measure(
        {
            "files_fingerprint": lambda: model_fingerprint(model.backbone, Path(folder), kwargs),
            "load_stamp_check": lambda: src.unchanged(model.backbone),
            "previous_fingerprint": lambda: legacy_fingerprint(model.backbone),
        },
        1,
        steps,
    )


def _figures(now: dict, before: dict | None) -> list[dict]:
    figs = [
        figure(
            "reload a probe checkpoint (HeadedModel.from_pretrained) ÷ transformers' "
            "from_pretrained of the backbone",
            now["load_ratio"],
            "ratio",
            GOAL,
        ),
        figure(
            "(transformers' load + headkit's own part of a reload) ÷ transformers' load",
            now["load_ratio_from_overhead"],
            "ratio",
        ),
        figure("save_pretrained of the probe", now["save_ms"], "ms"),
        figure("checkpoint size", now["checkpoint_bytes"], "bytes"),
    ]
    if "fingerprint_over_previous" in now:
        figs.append(
            figure(
                "backbone fingerprint: files ÷ the previous sums of every tensor",
                now["fingerprint_over_previous"],
                "ratio",
            )
        )
    if before is not None:
        figs.append(
            figure(
                "before: reload ÷ transformers' load (the --before headkit)",
                before["load_ratio"],
                "ratio",
                GOAL,
            )
        )
    return figs


def main(argv: list[str] | None = None) -> dict:
    """Measure; return (and write to --out) the result with its figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_measure_args(ap)
    ap.add_argument("--repeats", type=int, default=None, help="alternated reload pairs (3)")
    ap.add_argument("--saves", type=int, default=None, help="timed saves (5)")
    ap.add_argument("--before", type=Path, help="a checkout of the previous headkit")
    ap.add_argument("--scenario-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=HERE / "results" / f"{NAME}.json")
    args = ap.parse_args(argv)
    st = settings_of(args)
    repeats = args.repeats or (1 if st.quick else 3)
    saves = args.saves or (2 if st.quick else 5)
    now = scenario(st, repeats, saves)
    if args.scenario_only:  # the child of --before: print the measurements, write nothing
        print(json.dumps(now))
        return now
    before = None
    if args.before is not None:
        env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": str(args.before.resolve())}
        cmd = [sys.executable, __file__, "--scenario-only", "--repeats", str(repeats)]
        cmd += ["--saves", str(saves), "--threads", str(st.threads)]
        cmd += ["--quick"] if st.quick else []
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the --before run failed:\n{done.stderr[-3000:]}")
        before = json.loads(done.stdout.strip().splitlines()[-1])
        before["headkit"] = str(args.before)
    setting = {
        **st.as_dict(),
        "backbone": "a tiny random Llama (2 layers, hidden 64)"
        if st.quick
        else "SmolLM2-135M-Instruct Q4_1 GGUF (packaged), dequantised to fp32",
        "probe": "1 Linear, 2 outputs, mean pooling",
        "reload_pairs": repeats,
        "saves": saves,
    }
    details = {"now": now, **({"before": before} if before else {})}
    result = bench_result(NAME, _figures(now, before), setting, details, threads=st.threads)
    return publish(result, args.out)


if __name__ == "__main__":
    ensure_bench_env()
    main()
