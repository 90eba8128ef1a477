"""Activation registry: name → ``nn.Module`` factory. Add your own with ``ACTIVATIONS.register``."""

from __future__ import annotations

from torch import nn

from ..registry import Registry

ACTIVATIONS: Registry = Registry("activation", "activation")

for _name, _factory in {
    "linear": nn.Identity,
    "identity": nn.Identity,
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": nn.SiLU,
    "swish": nn.SiLU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "softmax": lambda: nn.Softmax(dim=-1),
    "log_softmax": lambda: nn.LogSoftmax(dim=-1),
    "softplus": nn.Softplus,
    "elu": nn.ELU,
    "leaky_relu": nn.LeakyReLU,
    "mish": nn.Mish,
}.items():
    ACTIVATIONS.register(_name, _factory)


def build_activation(name: str) -> nn.Module:
    """Instantiate the activation registered under ``name``."""
    return ACTIVATIONS.get(name)()
