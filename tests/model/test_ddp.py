"""DDP: two CPU ranks (torchrun, gloo) train like one process on the same global batch.

The worker (tests/model/ddp_worker.py) trains with HeadedTrainer and
``ddp_find_unused_parameters=False``; its "aux" head never gets labels, so DDP fails unless
HeadedModel puts every head (and learned loss weight) in each step's graph.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import ddp_worker
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from headkit import HeadedModel

WORKER = Path(__file__).with_name("ddp_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with the gloo backend",
)
def test_two_ranks_match_one_process_and_only_rank0_saves(tmp_path: Path) -> None:
    ddp_dir, single_dir = tmp_path / "ddp", tmp_path / "single"
    ddp_dir.mkdir()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        str(WORKER),
        str(ddp_dir),
        "4",  # per-device batch: 2 ranks × 4 = the 8 examples
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # meanwhile the reference: one process, batch 8 (in this process, on one thread)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ddp_worker.main(str(single_dir), 8)
    finally:
        torch.set_num_threads(before)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, (out[-2000:], err[-4000:])
    ranks = [json.loads((ddp_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    single = json.loads((single_dir / "rank0.json").read_text())
    assert single["world_size"] == 1
    assert len(single["losses"]) == ddp_worker.STEPS
    assert ranks[0]["losses"] == pytest.approx(single["losses"], rel=1e-5)
    # evaluation gathers predictions and per-head losses from both ranks
    evals = ranks[0]["eval"]
    assert evals.keys() == single["eval"].keys() and ranks[1]["eval"] == evals
    assert {"eval_loss", "eval_cls_loss", "eval_tok_loss", "eval_cls_accuracy"} <= evals.keys()
    for k, v in single["eval"].items():
        assert evals[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k

    w0, w1 = (load_file(str(ddp_dir / f"rank{r}.safetensors")) for r in (0, 1))
    ws = load_file(str(single_dir / "rank0.safetensors"))
    init = {k: v.detach() for k, v in ddp_worker.build_model().head_state_dict().items()}
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k  # both ranks hold the same weights
        torch.testing.assert_close(w0[k], ws[k], rtol=1e-4, atol=1e-6)
        trained = not torch.equal(w0[k], init[k])
        assert trained == ("aux" not in k), k  # the unlabelled head got exact zero gradients

    # one checkpoint, written by rank 0 only
    assert ranks[0]["should_save"] and not ranks[1]["should_save"]
    step = ddp_worker.STEPS
    assert ranks[0]["saves"] == [str(ddp_dir / "run" / f"checkpoint-{step}")]
    assert ranks[1]["saves"] == []
    run = ddp_dir / "run"
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-")) == [
        f"checkpoint-{step}"
    ]
    ckpt = run / f"checkpoint-{step}"
    assert len(list(ckpt.glob("heads-*.safetensors"))) == 1
    loaded = HeadedModel.from_pretrained(ckpt).head_state_dict()
    for k in w0:
        assert torch.equal(loaded[k].cpu(), w0[k]), k
