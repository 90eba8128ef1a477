"""HeadConfig: transformer-heads configs run verbatim, defaults, JSON, validation, registries."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import HIDDEN, build_tiny
from torch import nn

from headkit import (
    ACTIVATIONS,
    LOSSES,
    POOLINGS,
    ConfigError,
    HeadConfig,
    HeadedModel,
    LossSpec,
)
from headkit.heads.pooling import PoolingStrategy

pytestmark = pytest.mark.usefixtures("single_thread")


def transformer_heads_configs(hidden_size: int) -> list[HeadConfig]:
    """Two configs copied verbatim from a user's transformer-heads script."""
    return [
        HeadConfig(
            name=f"num_tokens_regression",  # noqa: F541 (verbatim from the user's script)
            layer_hook=-7,
            hidden_size=128,
            num_layers=3,
            in_size=hidden_size,
            output_activation="linear",
            is_causal_lm=False,
            pred_for_sequence=False,
            loss_fct="mse",
            num_outputs=1,
            is_regression=True,
            loss_weight=0.0002,
        ),
        HeadConfig(
            name="mean_regression",
            layer_hook=-11,
            in_size=hidden_size,
            output_activation="linear",
            is_causal_lm=False,
            pred_for_sequence=True,
            loss_fct="mse",
            num_outputs=1,
            is_regression=True,
            loss_weight=0.002,
        ),
    ]


# ---------------------------------------------------------------------- transformer-heads configs
def test_transformer_heads_configs_build_the_same_heads_on_a_12_layer_backbone():
    backbone = build_tiny("gpt2", num_layers=12)
    hidden_size = backbone.config.hidden_size  # as in the user's script
    model = HeadedModel(backbone, transformer_heads_configs(hidden_size)).eval()

    # num_layers=3, hidden_size=128: Linear(in,128) → ReLU → Linear(128,128) → ReLU → Linear(128,1)
    mlp = list(model.heads["num_tokens_regression"].mlp)
    assert [type(m) for m in mlp] == [nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear]
    shapes = [(m.in_features, m.out_features) for m in mlp if isinstance(m, nn.Linear)]
    assert shapes == [(HIDDEN, 128), (128, 128), (128, 1)]
    assert isinstance(model.heads["num_tokens_regression"].output_activation, nn.Identity)
    # the default num_layers=1: one Linear(in, 1)
    mlp = list(model.heads["mean_regression"].mlp)
    assert [type(m) for m in mlp] == [nn.Linear]
    assert (mlp[0].in_features, mlp[0].out_features) == (HIDDEN, 1)
    assert isinstance(model.heads["mean_regression"].output_activation, nn.Identity)
    # -7 and -11 index output_hidden_states of 13 entries
    assert model.hooked_layers() == {"num_tokens_regression": 6, "mean_regression": 2}

    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    n_tokens = torch.rand(2, 5, generator=torch.Generator().manual_seed(1))
    mean = torch.tensor([0.5, -1.0])
    out = model(input_ids=ids, num_tokens_regression=n_tokens, mean_regression=mean)
    assert out.preds_by_head["num_tokens_regression"].shape == (2, 5, 1)
    assert out.preds_by_head["mean_regression"].shape == (2, 1)

    # the heads read the same states as HF's output_hidden_states
    hs = backbone(input_ids=ids, output_hidden_states=True).hidden_states
    expected_tok = model.heads["num_tokens_regression"].mlp(hs[-7])
    expected_seq = model.heads["mean_regression"].mlp(hs[-11][:, -1])  # "last" pooling
    torch.testing.assert_close(out.preds_by_head["num_tokens_regression"], expected_tok)
    torch.testing.assert_close(out.preds_by_head["mean_regression"], expected_seq)
    # loss = Σ loss_weight × mse
    mse_tok = F.mse_loss(expected_tok.squeeze(-1), n_tokens)
    mse_seq = F.mse_loss(expected_seq.squeeze(-1), mean)
    torch.testing.assert_close(out.loss_by_head["num_tokens_regression"], mse_tok)
    torch.testing.assert_close(out.loss_by_head["mean_regression"], mse_seq)
    torch.testing.assert_close(out.loss, 0.0002 * mse_tok + 0.002 * mse_seq)


# ---------------------------------------------------------------------- defaults and construction
def test_defaults():
    c = HeadConfig("sentiment")
    assert c.target == "sentiment"
    assert c.ignore_pads is True  # not is_causal_lm
    assert (c.layer_hook, c.num_layers, c.hidden_size) == (-1, 1, 0)
    assert (c.in_size, c.num_outputs) == (None, None)  # filled from the backbone
    assert (c.loss_fct, c.loss_weight, c.output_activation) == ("cross_entropy", 1.0, "linear")
    assert (c.trainable, c.block_gradients, c.output_bias) == (True, False, False)

    lm = HeadConfig("lm_head", is_causal_lm=True)
    assert lm.ignore_pads is False and lm.target == "lm_head"
    assert HeadConfig("a", target="labels", ignore_pads=False).target == "labels"
    assert HeadConfig("a", ignore_pads=False).ignore_pads is False


def test_positional_construction_in_transformer_heads_order():
    args = ("probe", 64, 3, -2, 16, 2, "sigmoid", "y", False, True, False, True, "bce")
    c = HeadConfig(*args, False, 0.5, False, True)
    assert (c.name, c.in_size, c.num_outputs, c.layer_hook) == ("probe", 64, 3, -2)
    assert (c.hidden_size, c.num_layers, c.output_activation) == (16, 2, "sigmoid")
    assert (c.target, c.is_causal_lm, c.pred_for_sequence) == ("y", False, True)
    assert (c.is_regression, c.output_bias, c.loss_fct) == (False, True, "bce")
    assert (c.trainable, c.loss_weight, c.ignore_pads, c.block_gradients) == (
        False,
        0.5,
        False,
        True,
    )


def test_json_round_trip():
    c = HeadConfig(
        "pooled",
        num_outputs=3,
        layer_hook=-2,
        hidden_size=8,
        num_layers=2,
        pred_for_sequence=True,
        pooling="mean+max",
        dropout=0.1,
        hidden_activation="gelu",
        extra={"labels": ["neg", "neu", "pos"]},
    )
    assert HeadConfig.from_json(c.to_json()) == c
    assert HeadConfig.from_dict(c.to_dict()) == c
    assert c.to_dict()["pooling"] == "mean+max"
    assert HeadConfig.from_dict(c.to_dict()).to_json() == c.to_json()


# ---------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        ({"output_activation": "relux"}, ["output_activation", "'relux'", "sigmoid"]),
        ({"hidden_activation": "gelux"}, ["hidden_activation", "'gelux'", "gelu"]),
        ({"loss_fct": "hinge"}, ["loss_fct", "'hinge'", "cross_entropy"]),
        ({"pred_for_sequence": True, "pooling": "median"}, ["pooling", "'median'", "mean"]),
        ({"num_layers": 0}, ["num_layers", "0", ">= 1"]),
        ({"num_layers": 2}, ["hidden_size", "num_layers=2"]),
        (
            {"is_causal_lm": True, "pred_for_sequence": True},
            ["is_causal_lm=True", "pred_for_sequence=True"],
        ),
        ({"loss_weight": -1.0}, ["loss_weight", "-1.0", ">= 0"]),
        ({"loss_weight": float("nan")}, ["loss_weight", "nan", "finite"]),
        ({"loss_weight": math.inf}, ["loss_weight", "inf", "finite"]),
        ({"dropout": 1.0}, ["dropout", "1.0", "[0, 1)"]),
        ({"dropout": -0.1}, ["dropout", "-0.1", "[0, 1)"]),
        ({"loss_fct": "bce"}, ["loss_fct", "'bce'", "sigmoid"]),
        ({"loss_fct": "cross_entropy", "is_regression": True}, ["loss_fct", "cross_entropy"]),
        ({"pooling": "mean"}, ["pooling", "'mean'", "pred_for_sequence=True"]),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_invalid_config_is_a_config_error_naming_field_and_value(kwargs, needles):
    with pytest.raises(ConfigError) as err:
        HeadConfig("h", **kwargs)
    assert isinstance(err.value, ValueError)
    message = str(err.value)
    assert "'h'" in message  # the head's name
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_bce_with_sigmoid_and_cross_entropy_classification_are_valid():
    HeadConfig("p", loss_fct="bce", output_activation="sigmoid")
    HeadConfig("r", loss_fct="mse", is_regression=True)


def test_from_dict_rejects_unknown_fields():
    data = HeadConfig("h").to_dict() | {"bogus_field": 3}
    with pytest.raises(ConfigError, match="bogus_field"):
        HeadConfig.from_dict(data)


# ---------------------------------------------------------------------- registries
@pytest.fixture
def restore_registries():
    """Registries are global: put them back as they were after the test."""
    saved = [(r, dict(r._items)) for r in (ACTIVATIONS, LOSSES, POOLINGS)]
    yield
    for registry, items in saved:
        registry._items.clear()
        registry._items.update(items)


class Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


class MinPooling(PoolingStrategy):
    """Element-wise min over non-padding tokens."""

    def forward(self, hidden, mask, pooler=None):
        keep = mask.bool().unsqueeze(-1)
        return torch.where(keep, hidden, torch.finfo(hidden.dtype).max).min(1).values


def test_registries_accept_new_names(restore_registries, tiny_bert, token_batch):
    ACTIVATIONS.register("square", Square)
    LOSSES.register("quartic", LossSpec(lambda p, y: (p - y) ** 4))
    POOLINGS.register("min", MinPooling)
    with pytest.raises(ConfigError, match="'cube'"):
        HeadConfig("h", output_activation="cube")

    configs = [
        HeadConfig(
            "energy",
            output_activation="square",
            is_regression=True,
            loss_fct="quartic",
            pred_for_sequence=True,
            pooling="min",
        )
    ]
    model = HeadedModel(tiny_bert, configs).eval()
    y = torch.tensor([0.5, 1.0, 2.0])
    out = model(**token_batch, energy=y)

    last = tiny_bert(**token_batch).last_hidden_state
    linear = model.heads["energy"].linears[0]
    expected = linear(last.min(1).values) ** 2  # (batch, 1)
    torch.testing.assert_close(out.preds_by_head["energy"], expected)
    torch.testing.assert_close(out.loss, ((expected.squeeze(-1) - y) ** 4).mean())
