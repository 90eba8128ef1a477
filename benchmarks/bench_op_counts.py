"""What does a head cost in operations? Counted, not timed: deterministic on any machine.

On a GPU every aten operation a step dispatches is at least one kernel launch, so at small
batches the count sets the time. Counted with ``_ops.OpCounter`` (a ``TorchDispatchMode``;
view-like operations such as ``view``, ``t``, ``expand``, ``detach`` are left out: they launch
nothing) on tiny random GPT-2, Llama and BERT (2 layers, hidden 32, batch 2 x 8, padded):

- **per extra head**: a frozen train step (forward with labels, backward) with N heads of one
  kind on the last layer, minus the same step with one head, over N - 1, for a sequence head
  (mean pooling, cross-entropy), a token head (cross-entropy) and a sequence regression head
  (mean pooling, MSE). Goal: at most 12 (a Linear, its loss, the mean over what counts, the
  total, and their gradients; labels are checked and counted once per target). Host reads
  (``_local_scalar_dense``) per extra head: goal 0.
- **per head beyond N**: the same with 2N heads against N, over N. Heads that share labels
  and a stackable loss run it as one call (``headkit.losses.shared``), so past that call each
  head adds its matmul, its weight gradient, a row sum and an add. Goal: at most 4.
- **decode step**: one greedy step of ``HeadedModel.generate`` (frozen ``lm_head`` and a value
  head) against one of the backbone's own ``generate``, each the count of 12 new tokens minus
  that of 4, over 8. Goal: at most 1.02 x the backbone's step plus the heads' own matmuls; the
  figure is (headed step - heads' matmuls) / backbone step.

The same counts are asserted by tests/model/test_op_counts.py. Run (writes
benchmarks/results/op_counts.json; ``--quick``: 3 heads instead of 5, decode 2 + 4 tokens):
  HF_HUB_OFFLINE=1 python benchmarks/bench_op_counts.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import _ops
import torch
from _harness import Goal, add_measure_args, ensure_bench_env, settings_of
from _report import bench_result, figure, publish

HERE = Path(__file__).resolve().parent
NAME = "op_counts"
HEAD_GOAL = Goal("<=", _ops.MAX_OPS_PER_EXTRA_HEAD)
STACKED_GOAL = Goal("<=", _ops.MAX_OPS_PER_STACKED_HEAD)
HOST_READ_GOAL = Goal("<=", 0)
DECODE_GOAL = Goal("<=", _ops.MAX_DECODE_STEP_FACTOR)


def main(argv: list[str] | None = None) -> dict:
    """Count; return (and write to --out) the result with its figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_measure_args(ap)
    ap.add_argument("--out", type=Path, default=HERE / "results" / f"{NAME}.json")
    args = ap.parse_args(argv)
    st = settings_of(args)
    torch.set_num_threads(st.threads)
    n_heads = 3 if st.quick else 5
    first, more = (2, 4) if st.quick else (4, 8)
    figures, details = [], {"per_extra_head": {}, "decode_step": {}}
    for arch in _ops.ARCHS:
        for kind in _ops.KINDS:
            c = _ops.per_extra_head(arch, kind, n_heads)
            details["per_extra_head"][f"{arch}/{kind}"] = c
            figures.append(
                figure(f"ops per extra head, {kind}, {arch}", c["per_extra_head"], "ops", HEAD_GOAL)
            )
            figures.append(
                figure(
                    f"ops per head beyond {n_heads}, {kind}, {arch}",
                    c["per_stacked_head"],
                    "ops",
                    STACKED_GOAL,
                )
            )
            figures.append(
                figure(
                    f"host reads per extra head, {kind}, {arch}",
                    c["host_reads_per_extra_head"],
                    "reads",
                    HOST_READ_GOAL,
                )
            )
    for arch in _ops.DECODERS:
        d = _ops.decode_step_ops(arch, first, more)
        details["decode_step"][arch] = d
        figures.append(
            figure(
                f"decode step ops (less heads' matmuls) / backbone's, {arch}",
                d["ratio_less_head_matmuls"],
                "ratio",
                DECODE_GOAL,
            )
        )
        figures.append(figure(f"decode step ops with heads, {arch}", d["headed"], "ops"))
        figures.append(figure(f"decode step ops, the backbone's, {arch}", d["backbone"], "ops"))
    setting = {
        **st.as_dict(),
        "heads": n_heads,
        "decode_tokens": {"first": first, "more": more},
        "model": {
            "layers": _ops.LAYERS,
            "hidden": _ops.HIDDEN,
            "vocab": _ops.VOCAB,
            "batch": [_ops.BATCH, _ops.SEQ],
        },
        "counted": "aten operations under a TorchDispatchMode, view-like ones left out",
    }
    result = bench_result(NAME, figures, setting, details, threads=st.threads)
    return publish(result, args.out)


if __name__ == "__main__":
    ensure_bench_env()
    main()
