"""``first_parameter`` is ``next(module.parameters(), None)`` without the generators;
``resolve_device`` and ``on_device``, the device a user names."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny
from torch import nn

from headkit import ConfigError, HeadConfig, HeadedModel
from headkit.modules import device_of, first_parameter, on_device, resolve_device


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


def test_resolve_device_names_the_option_and_what_is_allowed():
    cpu = torch.device("cpu")
    assert resolve_device(None) == resolve_device("cpu") == resolve_device(cpu) == cpu
    auto = resolve_device("auto")
    assert auto.type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match=r"device='gpu' is invalid; allowed: cpu, cuda") as e:
        resolve_device("gpu")
    assert e.value.field == "device"
    unseen = f"cuda:{max(7, torch.cuda.device_count())}"
    with pytest.raises(ConfigError, match=rf"--device='{unseen}': torch sees no such device"):
        resolve_device(unseen, "--device")
    model = nn.Linear(2, 2)
    on_device(model, None)
    on_device(model, "cpu")  # where it is: nothing to say
    with pytest.raises(ConfigError, match="torch sees no such device"):
        on_device(model, unseen)
