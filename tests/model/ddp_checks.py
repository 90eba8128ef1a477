"""What the two-rank DDP runs of tests/model/distributed_worker.py must show, checked on the
reports of tests/model/test_ranks.py's one launch against one process."""

from __future__ import annotations

from pathlib import Path

import distributed_worker as worker
import pytest
import torch
from safetensors.torch import load_file

from headkit import HeadedModel


def check_two_ranks_match_one_process(
    out: Path, reports: list[dict], single_dir: Path, alone: dict
) -> None:
    """The "ddp" run of both ranks equals one process on the global batch; only rank 0
    saved, and its checkpoint loads with the trained weights."""
    ddp = [r["ddp"] for r in reports]
    assert [r["world_size"] for r in ddp] == [2, 2] and alone["world_size"] == 1
    assert len(alone["losses"]) == worker.STEPS
    assert ddp[0]["losses"] == pytest.approx(alone["losses"], rel=1e-5)
    # evaluation gathers predictions and per-head losses from both ranks
    evals = ddp[0]["eval"]
    assert evals.keys() == alone["eval"].keys() and ddp[1]["eval"] == evals
    assert {"eval_loss", "eval_cls_loss", "eval_tok_loss", "eval_cls_accuracy"} <= evals.keys()
    for k, v in alone["eval"].items():
        assert evals[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k

    w0, w1 = (load_file(str(out / f"ddp-rank{r}.safetensors")) for r in (0, 1))
    ws = load_file(str(single_dir / "ddp-rank0.safetensors"))
    init = {k: v.detach() for k, v in worker.build_ddp_model().head_state_dict().items()}
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k  # both ranks hold the same weights
        torch.testing.assert_close(w0[k], ws[k], rtol=1e-4, atol=1e-6)
        trained = not torch.equal(w0[k], init[k])
        assert trained == ("aux" not in k), k  # the unlabelled head got exact zero gradients

    # one checkpoint, written by rank 0 only
    assert ddp[0]["should_save"] and not ddp[1]["should_save"]
    ckpt = out / "run" / f"checkpoint-{worker.STEPS}"
    assert ddp[0]["saves"] == [str(ckpt)] and ddp[1]["saves"] == []
    run = out / "run"
    assert [p.name for p in run.iterdir() if p.name.startswith("checkpoint-")] == [ckpt.name]
    assert len(list(ckpt.glob("heads-*.safetensors"))) == 1
    loaded = HeadedModel.from_pretrained(ckpt).head_state_dict()
    for k in w0:
        assert torch.equal(loaded[k].cpu(), w0[k]), k


def check_early_exit_training(out: Path, reports: list[dict]) -> None:
    """The "loop" and "trainer" runs: both ranks hold the same weights, trained where a
    gradient reaches and untouched after the deepest hooked layer."""
    init, caught = worker.build_early_exit_model()
    assert len(caught) == 1 and "2 block(s) after it and ln_f" in caught[0]
    assert [r["loop"]["distributed_type"] for r in reports] == ["DistributedType.MULTI_CPU"] * 2
    init_state = {k: v.detach() for k, v in init.state_dict().items()}
    for mode in ("loop", "trainer"):
        modes = [r[mode] for r in reports]
        assert [r["world_size"] for r in modes] == [2, 2], mode
        assert [r["find_unused_parameters"] for r in modes] == [False, False], mode
        assert len(modes[0]["losses"]) == worker.STEPS, mode
        w0, w1 = (load_file(str(out / f"{mode}-rank{r}.safetensors")) for r in (0, 1))
        for k in w0:
            assert torch.equal(w0[k], w1[k]), (mode, k)  # both ranks hold the same weights
        moved = {k for k in w0 if not torch.equal(w0[k], init_state[k])}
        assert "heads.cls.mlp.0.weight" in moved and "backbone.h.0.attn.c_attn.weight" in moved
        frozen_parts = ("backbone.h.2.", "backbone.h.3.", "backbone.ln_f.", "heads.aux.")
        assert not any(k.startswith(frozen_parts) for k in moved), (mode, sorted(moved))
