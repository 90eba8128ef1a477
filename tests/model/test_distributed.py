"""DDP on two CPU ranks, and a head on a middle layer with a trainable backbone.

With early exit the blocks after the deepest hooked layer never run, so they can never get a
gradient: HeadedModel freezes them (and the final norm) at construction, warning once.

The two-rank checks (tests/model/ddp_checks.py) run on one launch per launcher: here
``accelerate launch --multi_gpu`` (tests/multiproc.py; without GPUs, CPU ranks over gloo);
under ``torchrun`` they share the one launch of tests/model/test_ranks.py. Each runs
tests/model/distributed_worker.py with DDP's
``find_unused_parameters=False``: a custom accelerate loop and HeadedTrainer with the
early-exit model, then HeadedTrainer training, evaluating and saving a model whose "aux"
head never gets labels, which DDP refuses unless HeadedModel puts every head (and learned
loss weight) in each step's graph. That last run must equal one process on the same
global batch (run here, while the ranks run).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import distributed_worker as worker
import pytest
import torch
import torch.distributed as dist
from conftest import build_tiny
from ddp_checks import check_early_exit_training, check_two_ranks_match_one_process
from multiproc import start_ranks

from headkit import HeadConfig, HeadedModel

WORKER = Path(worker.__file__)


# ---------------------------------------------------------------------- one process
def test_blocks_after_the_deepest_hook_are_frozen_with_one_warning():
    hf = build_tiny("gpt2", num_layers=4)
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
@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[Path, dict]:
    """The "ddp" training in this process on one thread, batch 8: the reference."""
    out = tmp_path_factory.mktemp("single")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return out, worker.train_eval_save(out, worker.N_EXAMPLES)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(
    scope="module",
    params=[pytest.param("accelerate", marks=pytest.mark.slow)],
)
def ranks(request, tmp_path_factory) -> tuple[Path, list[dict]]:
    """One launch of the worker on two ranks (the reference is computed meanwhile). Under
    torchrun the same runs happen in tests/model/test_ranks.py's one launch."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with the gloo backend")
    out = tmp_path_factory.mktemp(request.param)
    launch = start_ranks(WORKER, out, launcher=request.param, nprocs=2)
    request.getfixturevalue("single")
    return out, launch.reports()


def test_two_ranks_match_one_process_and_only_rank0_saves(ranks, single) -> None:
    out, reports = ranks
    check_two_ranks_match_one_process(out, reports, *single)


def test_two_ranks_train_an_early_exit_model_in_a_custom_loop_and_headed_trainer(ranks) -> None:
    out, reports = ranks
    check_early_exit_training(out, reports)
