"""What does saving and reloading a probe on SmolLM2-135M cost, next to loading the backbone?

Setting: the packaged SmolLM2-135M-Instruct (GGUF, dequantised to fp32 on load: 134.5M
parameters), one sequence probe (2 classes, mean pooling, layer 15), 2 threads. The backbone
is frozen and unchanged, so each save writes only the probe (~5 KB) and a reference to the
backbone; a reload loads the backbone through transformers and then the probe.

Measured in one process, alternated (see shared BENCHMARKING.md):
  hf_load        AutoModel.from_pretrained(smollm2_path(), gguf_file=SMOLLM2_GGUF)
  headkit_load   HeadedModel.from_pretrained(checkpoint)  (backbone + fingerprint + probe)
  save           model.save_pretrained(checkpoint)        (probe + reference + fingerprint)
  fingerprint    the backbone fingerprint alone, as this headkit computes it, and as the
                 previous one did (sums of every tensor), alternated on the same backbone
Medians, the ratio headkit_load / hf_load (goal <= 1.1), and how much other processes
loaded the machine during each timing (/proc/stat).

"Before" figures come from the same scenario run by the previous headkit (``--before PATH``:
a checkout of it, e.g. ``git archive c846a8c headkit | tar -x -C /tmp/headkit-base``), in a
child process, since only one headkit can be imported per process.

Run:
  MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 \
  MALLOC_TOP_PAD_=536870912 HF_HUB_OFFLINE=1 PYTHONPATH=. \
  python benchmarks/bench_checkpoint.py --before /tmp/headkit-base
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _harness import MALLOC_ENV, busy_seconds, own_seconds  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "checkpoint.json"


def timed(fn: Callable[[], object]) -> tuple[float, float, object]:
    """(wall seconds, cores other processes used meanwhile, fn's result)."""
    b0, o0, t0 = busy_seconds(), own_seconds(), time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t0
    other = max(0.0, (busy_seconds() - b0) - (own_seconds() - o0)) / wall
    return wall, other, out


def summary(samples: list[tuple[float, float]]) -> dict:
    return {
        "median_s": statistics.median(s for s, _ in samples),
        "samples_s": [round(s, 4) for s, _ in samples],
        "other_cores": [round(o, 2) for _, o in samples],
    }


def scenario(repeats: int, saves: int) -> dict:
    """Run the scenario with whichever headkit is importable; return its figures."""
    from transformers import AutoModel

    from headkit import HeadConfig, HeadedModel, load_headed
    from headkit.packaged import SMOLLM2_GGUF, smollm2_path

    torch.set_num_threads(2)
    probe = HeadConfig(
        "probe", num_outputs=2, pred_for_sequence=True, pooling="mean", layer_hook=15
    )
    path, gguf = str(smollm2_path()), SMOLLM2_GGUF
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])

    def hf_load():
        return AutoModel.from_pretrained(path, gguf_file=gguf, trust_remote_code=False)

    first_hf = timed(hf_load)  # warms the page cache; reported, not in the medians
    load_headed_s = timed(lambda: load_headed(path, head_configs=[probe], gguf_file=gguf))
    model = load_headed_s[2]
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(0.5)
        expected = model.eval()(ids).preds_by_head["probe"]
    out: dict = {"first_hf_load_s": first_hf[0], "load_headed_s": load_headed_s[0]}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "probe"
        save = [timed(lambda: model.save_pretrained(ckpt))[:2] for _ in range(saves)]
        out["checkpoint_bytes"] = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
        manifest = json.loads((ckpt / "head_configs.json").read_text())
        out["backbone_entry_kind"] = manifest["backbone"]["kind"]
        hf, headkit = [], []
        for _ in range(repeats):  # A B A B
            wall, other, backbone = timed(hf_load)
            hf.append((wall, other))
            wall, other, loaded = timed(lambda: HeadedModel.from_pretrained(ckpt))
            headkit.append((wall, other))
            with torch.no_grad():
                assert torch.equal(loaded.eval()(ids).preds_by_head["probe"], expected)
            del loaded
        out["overhead"] = _overhead(backbone, ckpt, path, gguf)
    out.update(save=summary(save), hf_load=summary(hf), headkit_load=summary(headkit))
    out["load_ratio"] = out["headkit_load"]["median_s"] / out["hf_load"]["median_s"]
    out["pair_ratios"] = [round(b[0] / a[0], 4) for a, b in zip(hf, headkit)]
    out["pair_ratio_median"] = statistics.median(out["pair_ratios"])
    extra = out["overhead"]["checkpoint"]["median_s"] + out["overhead"]["source"]["median_s"]
    out["load_ratio_from_overhead"] = (out["hf_load"]["median_s"] + extra) / out["hf_load"][
        "median_s"
    ]
    out["fingerprint"] = _fingerprints(model)
    return out


def _overhead(backbone, ckpt: Path, path: str, gguf: str) -> dict:
    """What headkit adds to a reload besides transformers' loading, timed on a loaded
    backbone: reading and verifying the checkpoint, building and loading the heads
    (``load_headed(backbone, head_folder_path=)``), and describing the source (fingerprint
    and, in this headkit, the load stamp: ``source_of``)."""
    from headkit import load_headed
    from headkit.backbone.sources import source_of

    apply, source = [], []
    for _ in range(5):
        apply.append(timed(lambda: load_headed(backbone, head_folder_path=ckpt))[:2])
        source.append(timed(lambda: source_of(backbone, path, None, {"gguf_file": gguf}))[:2])
    return {"checkpoint": summary(apply), "source": summary(source)}


def _fingerprints(model) -> dict | None:
    """This headkit's fingerprint work vs the previous one's, alternated on one backbone."""
    try:
        from headkit.backbone.fingerprint import LoadStamp, legacy_fingerprint
        from headkit.backbone.sources import model_fingerprint
    except ImportError:  # the previous headkit: it has none of these
        return None
    from headkit.packaged import SMOLLM2_GGUF, smollm2_path

    src = model.source
    folder, kwargs = smollm2_path(), {"gguf_file": SMOLLM2_GGUF}
    new, stamp, old = [], [], []
    for _ in range(5):
        new.append(timed(lambda: model_fingerprint(model.backbone, folder, kwargs))[:2])
        stamp.append(timed(lambda: src.unchanged(model.backbone))[:2])
        old.append(timed(lambda: legacy_fingerprint(model.backbone))[:2])
    assert isinstance(src.stamp, LoadStamp)
    return {
        "files_fingerprint": summary(new),
        "load_stamp_check": summary(stamp),
        "previous_fingerprint": summary(old),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="alternated reload pairs")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--before", type=Path, help="a checkout of the previous headkit")
    parser.add_argument("--json-only", action="store_true", help="print figures, write nothing")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result = {
        "setting": {
            "backbone": "SmolLM2-135M-Instruct Q4_1 GGUF (packaged), dequantised to fp32",
            "probe": "1 Linear, 2 outputs, mean pooling, layer 15",
            "threads": 2,
            "torch": torch.__version__,
            "malloc_env": all(os.environ.get(k) == v for k, v in MALLOC_ENV.items()),
        },
        "after": scenario(args.repeats, args.saves),
    }
    if args.json_only:
        print(json.dumps(result["after"]))
        return result
    if args.before is not None:
        env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": str(args.before.resolve())}
        cmd = [sys.executable, __file__, "--json-only", "--repeats", str(args.repeats)]
        cmd += ["--saves", str(args.saves)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        result["before"] = json.loads(done.stdout.strip().splitlines()[-1])
        result["before"]["headkit"] = str(args.before)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    _report(result)
    return result


def _report(result: dict) -> None:
    for when in ("before", "after"):
        r = result.get(when)
        if r is None:
            continue
        save, reload, hf = (r[k]["median_s"] for k in ("save", "headkit_load", "hf_load"))
        extra = r["overhead"]["checkpoint"]["median_s"] + r["overhead"]["source"]["median_s"]
        print(
            f"{when:6s} save {save:.3f} s | reload {reload:.2f} s vs transformers {hf:.2f} s "
            f"(ratio of medians {r['load_ratio']:.3f}, median of pairs "
            f"{r['pair_ratio_median']:.3f}) | headkit's own part of a reload {extra:.3f} s "
            f"(ratio {r['load_ratio_from_overhead']:.3f}) | load_headed {r['load_headed_s']:.2f} s"
        )


if __name__ == "__main__":
    main()
