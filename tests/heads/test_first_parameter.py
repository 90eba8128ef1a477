"""``first_parameter`` is ``next(module.parameters(), None)`` without the generators."""

from __future__ import annotations

import torch
from conftest import build_tiny
from torch import nn

from headkit import HeadConfig, HeadedModel
from headkit.modules import device_of, first_parameter


def test_first_parameter_is_the_first_of_parameters():
    empty = nn.Sequential(nn.ReLU(), nn.Sequential(nn.Identity()))
    inner = nn.Sequential(nn.Identity(), nn.Linear(2, 3))
    nested = nn.Sequential(nn.ReLU(), inner, nn.Linear(3, 1))
    bias_only = nn.Linear(2, 2)
    bias_only.weight = None  # a None slot is skipped, as parameters() skips it
    shared = nn.Linear(2, 2)
    tied = nn.Sequential(nn.Sequential(), shared, shared)
    model = HeadedModel(
        build_tiny("bert", 1),
        [HeadConfig("a", pooling="attention", pred_for_sequence=True), HeadConfig("b")],
    )
    modules = [empty, nested, bias_only, tied, model, model.heads, *model.heads.values()]
    for m in modules:
        assert first_parameter(m) is next(m.parameters(), None)
    assert device_of(empty) == torch.device("cpu")
    assert device_of(empty, torch.device("meta")) == torch.device("meta")
    assert device_of(nested.to("meta")) == torch.device("meta")
