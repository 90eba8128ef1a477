"""Heads and what they are built from: head kinds (``HEADS``), poolings (``POOLINGS``) and
activations (``ACTIVATIONS``)."""

from .activations import ACTIVATIONS
from .base import HEADS, Head, HeadDict, build_head
from .mlp import MLPHead
from .pooling import POOLINGS, PoolingStrategy, SequencePooling

__all__ = [
    "ACTIVATIONS",
    "HEADS",
    "POOLINGS",
    "Head",
    "HeadDict",
    "MLPHead",
    "PoolingStrategy",
    "SequencePooling",
    "build_head",
]
