"""What does serving a head with onnxruntime cost, next to eager headkit? (issue 24)

One process, per shared BENCHMARKING.md and ``_harness.measure``: the two sides alternated
step by step (A B, B A, ...) after warm-up, median of each, rerun when other processes used
more than 0.2 cores meanwhile. Inference (eval, no grad) of batch 8 x 128 tokens (rows padded
to lengths 128..72 on the right) on 2 threads (torch's and onnxruntime's intra-op):

  minilm  the packaged all-MiniLM-L6-v2 (6 layers, hidden 384) with one sequence head
          (mean pooling, 2 classes) on the last layer
  gpt2    a random 12-layer GPT-2 built from a config (hidden 256, 4 attention heads, vocab
          1000) with one token head (17 classes) on the last layer

Figures: onnxruntime ÷ eager headkit per model (goal <= 0.9), and the export time (the
export, not timed against anything: torch's dynamo exporter and the verification with
onnxruntime on four batches). The outputs of the two sides are compared once (max |diff|).

Run: make bench, or
  HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/bench_export.py
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from _harness import Goal, ensure_bench_env, measure

RESULTS = Path(__file__).parent / "results" / "export.json"
GOAL = Goal("<=", 0.9)
BATCH, SEQ, THREADS = 8, 128, 2


def _models():
    import torch
    from transformers import AutoModel, GPT2Config, GPT2Model

    from headkit import HeadConfig, HeadedModel
    from headkit.packaged import minilm_path

    torch.manual_seed(0)
    minilm = HeadedModel(
        AutoModel.from_pretrained(minilm_path()),
        [HeadConfig("sentiment", num_outputs=2, pred_for_sequence=True, pooling="mean")],
    )
    config = GPT2Config(
        n_layer=12,
        n_embd=256,
        n_head=4,
        vocab_size=1000,
        n_positions=512,
        bos_token_id=0,
        eos_token_id=0,
    )
    gpt2 = HeadedModel(GPT2Model(config), [HeadConfig("tags", num_outputs=17)])
    return {"minilm": minilm.eval(), "gpt2": gpt2.eval()}


def _batch(vocab: int, types: bool) -> dict:
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, vocab, (BATCH, SEQ), generator=g)
    mask = torch.zeros_like(ids)
    for i in range(BATCH):
        mask[i, : SEQ - 8 * i] = 1
    batch = {"input_ids": ids, "attention_mask": mask}
    if types:
        batch["token_type_ids"] = torch.zeros_like(ids)
    return batch


def scenario(name: str, model, warmup: int, steps: int) -> dict:
    import torch

    from headkit.integrations.onnx import export_onnx, session

    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        t0 = time.perf_counter()
        result = export_onnx(model, tmp)
        export_s = time.perf_counter() - t0
        sess = session(result.graph, threads=THREADS)
        wanted = [i.name for i in sess.get_inputs()]
        batch = _batch(model.get_input_embeddings().num_embeddings, "token_type_ids" in wanted)
        feed = {k: v.numpy() for k, v in batch.items() if k in wanted}
        head = result.description["outputs"][0]["name"]

        def eager():
            with torch.inference_mode():
                return model(**batch).preds_by_head[head]

        def ort():
            return sess.run([head], feed)[0]

        diff = float((eager() - torch.from_numpy(ort())).abs().max())
        timing = measure({"onnxruntime": ort, "eager": eager}, warmup, steps, quiet_timeout=30)
    ratio = timing.ratio("onnxruntime", "eager")
    return {
        "ratio": round(ratio, 4),
        "export_s": round(export_s, 1),
        "exporter": result.exporter,
        "blocks_in_graph": result.blocks,
        "max_abs_diff": diff,
        "timing": timing.summary(tokens=BATCH * SEQ),
    }


def main(argv: list[str] | None = None) -> dict:
    ensure_bench_env()
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    torch.set_num_threads(THREADS)
    results = {n: scenario(n, m, args.warmup, args.steps) for n, m in _models().items()}
    figures = []
    for n, r in results.items():
        figures.append(
            {
                "name": f"{n}: onnxruntime / eager inference",
                "value": r["ratio"],
                "unit": "ratio",
                "goal": str(GOAL),
                "met": GOAL.met(r["ratio"]),
            }
        )
        figures.append(
            {
                "name": f"{n}: export time",
                "value": r["export_s"],
                "unit": "s",
                "goal": None,
                "met": None,
            }
        )
    out = {
        "name": "export",
        "setting": f"batch {BATCH} x {SEQ} (right-padded 128..72), {THREADS} threads, eval",
        "figures": figures,
        "scenarios": results,
        "command": "python benchmarks/bench_export.py " + " ".join(argv or []),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    result = main(sys.argv[1:])
    for f in result["figures"]:
        print(
            f"{f['name']}: {f['value']} {f['unit']}" + (f" (goal {f['goal']})" if f["goal"] else "")
        )
