"""MLPHead: layer structure, activations, bias, dropout, gradient blocking, trainability."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from headkit import ConfigError, HeadConfig, HeadedModel, MLPHead

pytestmark = pytest.mark.usefixtures("single_thread")


def head(**kwargs) -> MLPHead:
    """An MLPHead on 8-wide states with 3 outputs unless told otherwise (seeded)."""
    torch.manual_seed(0)
    kwargs = {"name": "h", "in_size": 8, "num_outputs": 3} | kwargs
    return MLPHead(HeadConfig(**kwargs)).eval()


def states(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(7))


def test_num_layers_one_is_a_single_linear():
    h = head()
    assert [type(m) for m in h.mlp] == [nn.Linear]
    x = states(2, 5, 8)
    lin = h.linears[0]
    torch.testing.assert_close(h(x), x @ lin.weight.T)  # no bias by default (output_bias=False)
    assert h(x).shape == (2, 5, 3)


def test_num_layers_n_is_n_linears_with_activation_between():
    h = head(num_layers=3, hidden_size=16)
    assert [type(m) for m in h.mlp] == [nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear]
    assert [(m.in_features, m.out_features) for m in h.linears] == [(8, 16), (16, 16), (16, 3)]
    x = states(4, 8)
    a, b, c = h.linears
    expected = c(torch.relu(b(torch.relu(a(x)))))
    torch.testing.assert_close(h.from_features(x), expected)


@pytest.mark.parametrize(
    ("name", "module", "fn"),
    [
        ("gelu", nn.GELU, torch.nn.functional.gelu),
        ("silu", nn.SiLU, torch.nn.functional.silu),
        ("tanh", nn.Tanh, torch.tanh),
    ],
)
def test_hidden_activation_sits_between_layers_only(name, module, fn):
    h = head(num_layers=2, hidden_size=16, hidden_activation=name)
    assert [type(m) for m in h.mlp] == [nn.Linear, module, nn.Linear]
    assert isinstance(h.output_activation, nn.Identity)
    x = states(4, 8)
    a, b = h.linears
    torch.testing.assert_close(h.from_features(x), b(fn(a(x))))


@pytest.mark.parametrize(
    ("name", "low", "high", "fn"),
    [("sigmoid", 0.0, 1.0, torch.sigmoid), ("tanh", -1.0, 1.0, torch.tanh)],
)
def test_output_activation_follows_the_last_layer_only(name, low, high, fn):
    h = head(num_layers=2, hidden_size=16, output_activation=name)
    assert [type(m) for m in h.mlp] == [nn.Linear, nn.ReLU, nn.Linear]  # nothing else inside
    x = 3 * states(64, 8)
    y = h.from_features(x)
    assert bool(((y > low) & (y < high)).all())
    a, b = h.linears
    torch.testing.assert_close(y, fn(b(torch.relu(a(x)))))
    # the raw last-layer outputs do leave the range: the activation is what bounds them
    raw = b(torch.relu(a(x)))
    assert bool(((raw < low) | (raw > high)).any())


@pytest.mark.parametrize("output_bias", [False, True])
def test_output_bias_applies_to_the_last_layer_only(output_bias):
    h = head(num_layers=3, hidden_size=16, output_bias=output_bias)
    first, second, last = h.linears
    assert first.bias is not None and second.bias is not None
    assert (last.bias is not None) == output_bias


def test_dropout_is_active_in_training_and_off_in_eval():
    h = head(num_layers=2, hidden_size=16, dropout=0.5)
    drops = [m for m in h.mlp if isinstance(m, nn.Dropout)]
    assert [d.p for d in drops] == [0.5, 0.5]  # before each Linear
    x = states(16, 8)
    a, b = h.linears
    plain = b(torch.relu(a(x)))
    h.eval()
    torch.testing.assert_close(h.from_features(x), plain)
    h.train()
    torch.manual_seed(1)
    noisy = h.from_features(x)
    assert not torch.allclose(noisy, plain)


def test_in_size_mismatch_is_a_config_error():
    with pytest.raises(ConfigError, match=r"width 6 but in_size=8"):
        head()(states(2, 3, 6))


def test_repr_shows_the_config():
    text = repr(head(num_layers=2, hidden_size=16, layer_hook=-3, pred_for_sequence=True))
    for needle in (
        "name='h'",
        "layer_hook=-3",
        "kind=sequence",
        "in_size=8",
        "hidden_size=16",
        "num_layers=2",
        "num_outputs=3",
    ):
        assert needle in text, text


# ---------------------------------------------------------------------- inside a HeadedModel
def _backbone_grads(model: HeadedModel) -> list[torch.Tensor]:
    return [p.grad for p in model.backbone.parameters() if p.grad is not None]


def test_block_gradients_keeps_the_backbone_out_of_that_heads_backward(tiny_gpt2, token_batch):
    cfg = HeadConfig("tagger", num_outputs=4, block_gradients=True)
    model = HeadedModel(tiny_gpt2, [cfg], freeze_base_model=False)
    labels = token_batch["input_ids"] % 4
    model(**token_batch, tagger=labels).loss.backward()
    assert _backbone_grads(model) == []  # not even zeros: no graph reaches the backbone
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.heads.parameters())

    # the same head without block_gradients does train the (unfrozen) backbone
    model.zero_grad(set_to_none=True)
    open_model = HeadedModel(
        tiny_gpt2, [cfg.replace(block_gradients=False)], freeze_base_model=False
    )
    open_model(**token_batch, tagger=labels).loss.backward()
    assert any(g.abs().sum() > 0 for g in _backbone_grads(open_model))


def test_untrainable_head_gets_no_gradient(tiny_bert, token_batch):
    configs = [
        HeadConfig("fixed", num_outputs=2, trainable=False),
        HeadConfig("learned", num_outputs=2),
    ]
    model = HeadedModel(tiny_bert, configs)
    assert not any(p.requires_grad for p in model.heads["fixed"].parameters())
    labels = token_batch["input_ids"] % 2
    model(**token_batch, fixed=labels, learned=labels).loss.backward()
    assert all(p.grad is None for p in model.heads["fixed"].parameters())
    assert all(p.grad is not None for p in model.heads["learned"].parameters())
    assert _backbone_grads(model) == []  # frozen backbone (the default)
