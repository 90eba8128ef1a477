"""Every extension point is a ``Registry``: loss weightings too (``WEIGHTINGS``), so a scheme a
user registers saves and loads back; a name registered twice is a ConfigError in every one."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny
from torch import nn

from headkit import ACTIVATIONS, HEADS, LOSSES, POOLINGS, ConfigError, HeadConfig, HeadedModel
from headkit.checkpoint import MANIFEST
from headkit.losses import WEIGHTINGS, LossSpec, LossWeighting
from headkit.registry import Registry

pytestmark = pytest.mark.usefixtures("single_thread")

HEADS_AB = [
    HeadConfig("a", num_outputs=3, pred_for_sequence=True, loss_weight=2.0),
    HeadConfig("b", pred_for_sequence=True, is_regression=True, loss_fct="mse"),
]
BATCH = {"input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])}
LABELS = {"a": torch.tensor([0, 2]), "b": torch.tensor([0.5, -1.0])}


class CappedWeighting(LossWeighting):
    """A scheme of a test: weight × min(loss, cap) × a learned scale per head, and a step count."""

    def __init__(self, weights, cap: float = 1.0):
        super().__init__(weights)
        self.cap = float(cap)
        self.scale = nn.ParameterDict({k: nn.Parameter(torch.ones(())) for k in weights})
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, losses):
        if self.training:
            self.steps += 1
        return {
            k: self.weights[k] * self.scale[k] * v.clamp(max=self.cap) for k, v in losses.items()
        }

    def config(self):
        return {"name": self.name, "cap": self.cap}


@pytest.fixture
def capped():
    WEIGHTINGS.register("capped_test", CappedWeighting)
    yield "capped_test"
    WEIGHTINGS.remove("capped_test")


def test_weightings_are_a_registry_like_the_others():
    assert isinstance(WEIGHTINGS, Registry)
    assert {"fixed", "adaptive", "uncertainty"} <= set(WEIGHTINGS.names())
    model = HeadedModel(build_tiny("bert", num_layers=2), HEADS_AB, loss_weighting="adaptive")
    assert model.loss_weighting.name == "adaptive" and WEIGHTINGS.get("ADAPTIVE") is type(
        model.loss_weighting
    )
    with pytest.raises(
        ConfigError,
        match=r"loss_weighting='nope' is not a known loss weighting; allowed: adaptive, fixed",
    ):
        model.set_loss_weighting("nope")


def test_a_registered_weighting_saves_and_loads_back(capped, tmp_path):
    model = HeadedModel(
        build_tiny("bert", num_layers=2), HEADS_AB, loss_weighting={"name": capped, "cap": 0.3}
    )
    assert isinstance(model.loss_weighting, CappedWeighting) and model.loss_weighting.cap == 0.3
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for _ in range(3):
        out = model(**BATCH, **LABELS)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    scale = {k: float(v.detach()) for k, v in model.loss_weighting.scale.items()}
    assert all(v != 1.0 for v in scale.values())  # learned
    model.save_pretrained(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / MANIFEST).read_text())
    assert manifest["loss_weighting"] == {"name": capped, "cap": 0.3}
    again = HeadedModel.from_pretrained(tmp_path / "ckpt")
    assert isinstance(again.loss_weighting, CappedWeighting) and again.loss_weighting.cap == 0.3
    assert int(again.loss_weighting.steps) == 3
    assert {k: float(v.detach()) for k, v in again.loss_weighting.scale.items()} == scale
    model.eval()
    again.eval()
    want, got = model(**BATCH, **LABELS), again(**BATCH, **LABELS)
    assert torch.equal(got.loss, want.loss)


def test_an_unregistered_weighting_is_refused_before_anything_is_written(tmp_path):
    class Unnamed(LossWeighting):
        pass

    model = HeadedModel(
        build_tiny("bert", num_layers=2), HEADS_AB, loss_weighting=Unnamed({"a": 2.0, "b": 1.0})
    )
    assert model.loss_weighting.name is None
    assert float(model(**BATCH, **LABELS).loss.detach()) > 0  # only saving needs the name
    with pytest.raises(
        ConfigError,
        match=r"loss_weighting=Unnamed is not registered in WEIGHTINGS.*@WEIGHTINGS.register",
    ):
        model.save_pretrained(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_a_registered_weighting_whose_config_names_another_scheme_is_refused(tmp_path):
    class Renamed(LossWeighting):
        def config(self):
            return {"name": "fixed"}  # would come back as a plain LossWeighting

    WEIGHTINGS.register("renamed_test", Renamed)
    try:
        model = HeadedModel(
            build_tiny("bert", num_layers=2), HEADS_AB, loss_weighting="renamed_test"
        )
        with pytest.raises(
            ConfigError,
            match=r"config\(\) names 'fixed', but Renamed is registered as 'renamed_test'",
        ):
            model.save_pretrained(tmp_path / "ckpt")
    finally:
        WEIGHTINGS.remove("renamed_test")


@pytest.mark.parametrize(
    "registry, name, item",
    [
        (ACTIVATIONS, "relu", nn.ReLU),
        (LOSSES, "mse", LossSpec(lambda p, y: (p - y) ** 2)),
        (POOLINGS, "Mean", object),
        (HEADS, "mlp", object),
        (WEIGHTINGS, "fixed", object),
    ],
    ids=["activations", "losses", "poolings", "heads", "weightings"],
)
def test_a_name_registered_twice_is_a_config_error(registry, name, item):
    before = registry.get(name)
    with pytest.raises(ConfigError, match=rf"{registry.kind} {name!r} is already registered") as e:
        registry.register(name, item)
    assert isinstance(e.value, ValueError) and registry.get(name) is before
    with pytest.raises(ConfigError, match=r"name must be a non-empty string"):
        registry.register("  ", item)
    registry.register(name, item, overwrite=True)  # replacing is asked for by name
    try:
        assert registry.get(name) is item
    finally:
        registry.register(name, before, overwrite=True)
