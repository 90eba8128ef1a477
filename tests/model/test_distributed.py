"""A head on a middle layer with a trainable backbone, in one process.

With early exit the blocks after the deepest hooked layer never run, so they can never get a
gradient: HeadedModel freezes them (and the final norm) at construction, warning once. The
same models trained with DDP on two CPU ranks are in tests/model/test_ranks.py (its one
launch runs tests/model/distributed_worker.py, checked by tests/model/ddp_checks.py).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import distributed_worker as worker
import pytest
import torch
from conftest import build_tiny

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
