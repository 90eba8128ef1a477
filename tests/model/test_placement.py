"""Heads on the device of the block that produces their layer (``headkit.distributed.placement``).

The rule is tested on the CPU with hand-written device maps (accelerate's ``hf_device_map``:
module name → device); a head built on "meta" shows that HeadedModel follows it. The real
placement over two CUDA devices — forward, losses, backward — is the ``gpu`` test at the end.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny

from headkit import HeadConfig, HeadedModel
from headkit.distributed.placement import execution_device

CUDA = torch.device("cuda", 0), torch.device("cuda", 1)


@pytest.mark.parametrize(
    "device_map, module, expected",
    [
        ({"h.0": 0, "h.1": 1}, "h.1", CUDA[1]),  # an accelerator index
        ({"h.0": 0, "h.1": 1}, "h.1.attn.c_attn", CUDA[1]),  # inside a mapped module
        ({"": "cuda:1"}, "h.3", CUDA[1]),  # one entry for the whole model
        ({"h": 0, "h.2": 1}, "h.2", CUDA[1]),  # the closest entry wins
        ({"h.0": 1, "h.1": "cpu"}, "h.1", CUDA[1]),  # offloaded: runs on the main device
        ({"h.0": "cpu", "h.1": "disk"}, "h.1", torch.device("cpu")),  # no accelerator at all
        ({"h.0.attn": 0, "h.0.mlp": 1}, "h.0", CUDA[1]),  # a split block: its last part
        ({"h.0": 0}, "ln_f", None),  # nothing about it
        ({"h.0": torch.device("meta")}, "h.0", torch.device("meta")),
    ],
)
def test_the_device_a_module_runs_on(device_map, module, expected):
    assert execution_device(device_map, module) == expected


def _gpt2_with_map(device_map: dict) -> torch.nn.Module:
    hf = build_tiny("gpt2", 3)
    hf.hf_device_map = device_map  # what from_pretrained(device_map=...) records
    return hf


HEADS = [
    HeadConfig("emb", layer_hook=0),  # the first block's input: the embeddings
    HeadConfig("one", layer_hook=1),  # block 0's output
    HeadConfig("two", layer_hook=2),  # block 1's output
    HeadConfig("last", layer_hook=-1),  # the final norm's output (last_hidden_state)
]


def test_each_head_is_built_on_the_device_of_the_block_producing_its_layer():
    # cuda:1 would not build here; "meta" is a device every torch has
    meta = "meta"
    device_map = {
        "transformer.wte": "cpu",
        "transformer.wpe": "cpu",
        "transformer.h.0": meta,
        "transformer.h.1": "cpu",
        "transformer.ln_f": meta,
        "lm_head": meta,
    }
    # the map has an accelerator-like device (meta), so "cpu" entries are offloaded to it
    model = HeadedModel(_gpt2_with_map(device_map), HEADS)
    assert {n: h.mlp[0].weight.device.type for n, h in model.heads.items()} == dict.fromkeys(
        ["emb", "one", "two", "last"], meta
    )


def test_heads_follow_a_map_that_leaves_some_producers_out():
    # blocks the map says nothing about run where the backbone's parameters are
    model = HeadedModel(_gpt2_with_map({"transformer.h.0": "meta"}), HEADS)
    devices = {n: h.mlp[0].weight.device.type for n, h in model.heads.items()}
    assert devices == {"emb": "cpu", "one": "meta", "two": "cpu", "last": "cpu"}
    # the loss weighting sits with the first head, where the total loss is gathered
    weighted = HeadedModel(
        _gpt2_with_map({"transformer.h.0": "meta"}),
        [HEADS[1], HEADS[2]],
        loss_weighting="uncertainty",
    )
    assert {p.device.type for p in weighted.loss_weighting.parameters()} == {"meta"}


def test_without_a_device_map_heads_sit_with_the_backbone(tiny_gpt2):
    model = HeadedModel(tiny_gpt2, HEADS)
    assert {h.mlp[0].weight.device.type for h in model.heads.values()} == {"cpu"}


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices (a device map over both)"
)
def test_a_device_map_over_two_gpus_puts_each_head_with_its_layer(tmp_path):
    from transformers import GPT2LMHeadModel

    build_tiny("gpt2", 4).save_pretrained(tmp_path / "gpt2")
    first = ["wte", "wpe", "drop", "h.0", "h.1"]
    device_map = {**{f"transformer.{n}": 0 for n in first}, "lm_head": 1}
    device_map.update({f"transformer.{n}": 1 for n in ["h.2", "h.3", "ln_f"]})
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2", device_map=device_map)
    heads = [
        HeadConfig("early", layer_hook=2, num_outputs=3, pred_for_sequence=True),
        HeadConfig("late", layer_hook=-1, num_outputs=4),
    ]
    model = HeadedModel(hf, heads, freeze_base_model=False)
    assert model.heads["early"].mlp[0].weight.device == torch.device("cuda", 0)
    assert model.heads["late"].mlp[0].weight.device == torch.device("cuda", 1)
    ids = torch.randint(3, 100, (2, 5), device="cuda:0")
    out = model(input_ids=ids, early=torch.tensor([0, 2]), late=ids % 4)
    assert out.preds_by_head["late"].device == torch.device("cuda", 1)
    assert out.loss.device == torch.device("cuda", 0)  # gathered on the first head's device
    out.loss.backward()
    assert model.heads["late"].mlp[0].weight.grad is not None
    # the same predictions as on one device
    cpu = HeadedModel(GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2"), heads)
    cpu.heads.load_state_dict({k: v.cpu() for k, v in model.heads.state_dict().items()})
    with torch.no_grad():
        want = cpu(input_ids=ids.cpu()).preds_by_head
    for name, pred in out.preds_by_head.items():
        torch.testing.assert_close(pred.detach().cpu(), want[name], rtol=1e-4, atol=1e-5)
