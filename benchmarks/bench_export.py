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

Run (writes benchmarks/results/export.json; ``--quick``: a smoke test, one export of a tiny
GPT-2 by the TorchScript exporter):
  HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/bench_export.py
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _harness import Goal, add_measure_args, ensure_bench_env, settings_of
from _report import bench_result, figure, publish

HERE = Path(__file__).resolve().parent
NAME = "export"
GOAL = Goal("<=", 0.9)


_DESCRIPTIONS = {
    "minilm": lambda quick: "packaged all-MiniLM-L6-v2, a mean-pooled sequence head",
    "gpt2": lambda quick: (
        "random GPT-2, "
        + ("2 layers, hidden 64" if quick else "12 layers, hidden 256")
        + ", a token head"
    ),
}


def _models(quick: bool) -> dict:
    import torch
    from transformers import AutoModel, GPT2Config, GPT2Model

    from headkit import HeadConfig, HeadedModel
    from headkit.packaged import minilm_path

    torch.manual_seed(0)
    layers, width = (2, 64) if quick else (12, 256)
    config = GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=4,
        vocab_size=1000,
        n_positions=512,
        bos_token_id=0,
        eos_token_id=0,
    )
    gpt2 = HeadedModel(GPT2Model(config), [HeadConfig("tags", num_outputs=17)]).eval()
    if quick:  # one export: a smoke test of the measurement, not of the exporter
        return {"gpt2": gpt2}
    sentiment = HeadConfig("sentiment", num_outputs=2, pred_for_sequence=True, pooling="mean")
    minilm = HeadedModel(AutoModel.from_pretrained(minilm_path()), [sentiment]).eval()
    return {"minilm": minilm, "gpt2": gpt2}


def _batch(vocab: int, types: bool, batch: int, seq: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, vocab, (batch, seq), generator=g)
    mask = torch.zeros_like(ids)
    for i in range(batch):
        mask[i, : seq - (seq // 16) * i] = 1
    out = {"input_ids": ids, "attention_mask": mask}
    if types:
        out["token_type_ids"] = torch.zeros_like(ids)
    return out


def scenario(model, st, batch: int, seq: int, exporter: str) -> dict:
    """Export ``model``, then time onnxruntime against eager headkit on one batch."""
    import torch

    from headkit.integrations.onnx import export_onnx, session

    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        t0 = time.perf_counter()
        result = export_onnx(model, tmp, exporter=exporter)
        export_s = time.perf_counter() - t0
        sess = session(result.graph, threads=st.threads)
        wanted = [i.name for i in sess.get_inputs()]
        vocab = model.get_input_embeddings().num_embeddings
        inputs = _batch(vocab, "token_type_ids" in wanted, batch, seq)
        feed = {k: v.numpy() for k, v in inputs.items() if k in wanted}
        head = result.description["outputs"][0]["name"]

        def eager():
            with torch.inference_mode():
                return model(**inputs).preds_by_head[head]

        def ort():
            return sess.run([head], feed)[0]

        diff = float((eager() - torch.from_numpy(ort())).abs().max())
        timing = st.measure({"onnxruntime": ort, "eager": eager})
    return {
        "ratio": timing.ratio("onnxruntime", "eager"),
        "export_s": export_s,
        "exporter": result.exporter,
        "blocks_in_graph": result.blocks,
        "max_abs_diff": diff,
        "timing": timing.summary(tokens=batch * seq),
    }


def main(argv: list[str] | None = None) -> dict:
    """Measure; return (and write to --out) the result with its figures."""
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_measure_args(ap)
    ap.add_argument("--out", type=Path, default=HERE / "results" / f"{NAME}.json")
    ap.add_argument(
        "--exporter", default=None, help="auto (the default), dynamo or torchscript (quick)"
    )
    args = ap.parse_args(argv)
    st = settings_of(args)
    exporter = args.exporter or ("torchscript" if st.quick else "auto")
    batch, seq = (2, 16) if st.quick else (8, 128)
    torch.set_num_threads(st.threads)
    details = {n: scenario(m, st, batch, seq, exporter) for n, m in _models(st.quick).items()}
    figures = []
    for n, r in details.items():
        figures.append(figure(f"{n}: onnxruntime / eager inference", r["ratio"], "ratio", GOAL))
        figures.append(figure(f"{n}: export time", r["export_s"], "s"))
    settings = {
        **st.as_dict(),
        "exporter": exporter,
        "batch": batch,
        "seq": seq,
        "padding": f"right, rows {seq}..{seq - (seq // 16) * (batch - 1)} long",
        "models": {n: _DESCRIPTIONS[n](st.quick) for n in details},
    }
    result = bench_result(NAME, figures, settings, details, threads=st.threads)
    return publish(result, args.out)


if __name__ == "__main__":
    ensure_bench_env()
    main()
