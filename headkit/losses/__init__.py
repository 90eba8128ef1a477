"""The objective: losses (``LOSSES`` of ``LossSpec``), the label rule (``label_rule``,
``target_rules``) and how head losses are weighted (``WEIGHTINGS`` of ``LossWeighting``)."""

from .objective import LOSSES, LabelRule, LossSpec, TargetRule, head_loss, label_rule, target_rules
from .weighting import WEIGHTINGS, LossWeighting

__all__ = [
    "LOSSES",
    "WEIGHTINGS",
    "LabelRule",
    "LossSpec",
    "LossWeighting",
    "TargetRule",
    "head_loss",
    "label_rule",
    "target_rules",
]
