"""Heads and what they are built from: head kinds (``HEADS``), poolings (``POOLINGS``) and
activations (``ACTIVATIONS``)."""

from .activations import ACTIVATIONS
from .base import HEADS, Head
from .mlp import MLPHead
from .pooling import POOLINGS, PoolingStrategy

__all__ = ["ACTIVATIONS", "HEADS", "POOLINGS", "Head", "MLPHead", "PoolingStrategy"]
