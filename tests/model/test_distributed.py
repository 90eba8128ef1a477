"""A head on a middle layer with a trainable backbone under DDP (find_unused_parameters=False).

With early exit the blocks after the deepest hooked layer never run, so they can never get a
gradient: HeadedModel freezes them (and the final norm) at construction, warning once. The
two-process tests launch tests/model/distributed_worker.py (a custom accelerate loop, then
HeadedTrainer) with ``torchrun --nproc_per_node=2`` and with
``accelerate launch --multi_gpu --num_processes 2`` (on a machine without GPUs accelerate
then runs two CPU processes over gloo; ``--cpu`` cannot be combined with ``--multi_gpu``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import distributed_worker as worker
import pytest
import torch
import torch.distributed as dist
from conftest import build_tiny
from safetensors.torch import load_file

from headkit import HeadConfig, HeadedModel

WORKER = Path(__file__).with_name("distributed_worker.py")
REPO = Path(__file__).resolve().parents[2]
needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with the gloo backend",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- one process
def test_blocks_after_the_deepest_hook_are_frozen_with_one_warning(make_tiny):
    hf = make_tiny("gpt2", num_layers=4)
    heads = [HeadConfig("probe", layer_hook=2, num_outputs=3)]
    with pytest.warns(UserWarning, match=r"hidden state 2 of 4, so 2 block\(s\) after it and ln_f"):
        model = HeadedModel(hf, heads, freeze_base_model=False)
    frozen = {n for n, p in model.backbone.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith(("h.2.", "h.3.", "ln_f.")) for n in frozen)
    assert {n.split(".")[0] + n.split(".")[1] for n in frozen if n.startswith("h.")} == {
        "h2",
        "h3",
    }
    trainable = [n for n, p in model.backbone.named_parameters() if p.requires_grad]
    assert any(n.startswith("h.1.") for n in trainable) and "wte.weight" in trainable
    # what stays trainable is exactly what gets a gradient
    ids = torch.randint(3, 100, (2, 5))
    model.train()(input_ids=ids, probe=ids % 3).loss.backward()
    got = {n for n, p in model.backbone.named_parameters() if p.grad is not None}
    assert got == set(trainable)


@pytest.mark.parametrize(
    "arch, heads, expect",
    [
        ("gpt2", [HeadConfig("top", layer_hook=-1)], set()),  # a last-layer head: all train
        ("llama", [HeadConfig("p", layer_hook=1)], {"layers.1.", "layers.2.", "norm."}),
        ("bert", [HeadConfig("p", layer_hook=2)], {"encoder.layer.2.", "pooler."}),
        # the pooler runs when a head pools with it: only the last block is frozen
        (
            "bert",
            [HeadConfig("p", layer_hook=2, pred_for_sequence=True, pooling="pooler")],
            {"encoder.layer.2."},
        ),
    ],
)
def test_what_is_frozen_by_architecture(arch, heads, expect):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = HeadedModel(build_tiny(arch), heads, freeze_base_model=False)
    frozen = {n for n, p in model.backbone.named_parameters() if not p.requires_grad}
    prefixes = {next((e for e in expect if n.startswith(e)), n) for n in frozen}
    assert prefixes == expect


def test_a_frozen_backbone_warns_about_nothing(tiny_gpt2):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HeadedModel(tiny_gpt2, [HeadConfig("probe", layer_hook=1)])


# ---------------------------------------------------------------------- two processes
def _env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }


def _check_two_ranks(out: Path) -> None:
    init, caught = worker.build_model()
    assert len(caught) == 1 and "2 block(s) after it and ln_f" in caught[0]
    init_state = {k: v.detach() for k, v in init.state_dict().items()}
    for mode in ("loop", "trainer"):
        reports = [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in (0, 1)]
        assert [r["world_size"] for r in reports] == [2, 2], mode
        assert [r["find_unused_parameters"] for r in reports] == [False, False], mode
        assert len(reports[0]["losses"]) == worker.STEPS, mode
        w0, w1 = (load_file(str(out / f"{mode}-rank{r}.safetensors")) for r in (0, 1))
        for k in w0:
            assert torch.equal(w0[k], w1[k]), (mode, k)  # both ranks hold the same weights
        moved = {k for k in w0 if not torch.equal(w0[k], init_state[k])}
        assert "heads.cls.mlp.0.weight" in moved and "backbone.h.0.attn.c_attn.weight" in moved
        frozen_parts = ("backbone.h.2.", "backbone.h.3.", "backbone.ln_f.", "heads.aux.")
        assert not any(k.startswith(frozen_parts) for k in moved), (mode, sorted(moved))


@pytest.mark.slow
@needs_gloo
def test_torchrun_two_ranks_custom_loop_and_headed_trainer(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        str(WORKER),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    _check_two_ranks(tmp_path)


@pytest.mark.slow
@needs_gloo
def test_accelerate_launch_two_cpu_ranks_custom_loop_and_headed_trainer(tmp_path: Path) -> None:
    launcher = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    if launcher is None:
        pytest.skip("the accelerate command is not installed next to this Python")
    cmd = [
        launcher,
        "launch",
        "--multi_gpu",
        "--num_processes=2",
        "--num_machines=1",
        "--mixed_precision=no",
        "--dynamo_backend=no",
        f"--main_process_port={_free_port()}",
        str(WORKER),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    report = json.loads((tmp_path / "loop-rank0.json").read_text())
    assert report["distributed_type"] == "DistributedType.MULTI_CPU"
    _check_two_ranks(tmp_path)
