"""The objective: losses (``LOSSES`` of ``LossSpec``) and how head losses are weighted."""

from .objective import LOSSES, LossSpec, head_loss
from .weighting import LossWeighting

__all__ = ["LOSSES", "LossSpec", "LossWeighting", "head_loss"]
