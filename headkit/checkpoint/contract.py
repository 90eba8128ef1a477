"""What checkpoint code needs of a model: ``CheckpointModel``, a structural type.

``save``, ``restore``, ``adapters``, ``borrow`` and ``card`` read these attributes and call
these methods, and nothing else; ``HeadedModel`` provides them (as would any model class given
to ``restore(model_cls=...)``). The checkpoint package never imports the model package.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn


class CheckpointModel(Protocol):
    """The model as ``checkpoint/`` sees it."""

    #: the bare transformer (peft adapters inside it, if any)
    backbone: nn.Module
    #: where the backbone was loaded from (``backbone.sources.BackboneSource``), or None
    source: Any
    #: what inspection found (``backbone.inspection.BackboneInfo``: its ``layers_path``, ...)
    info: Any
    #: the block stack's path when given by hand (saved so that loading finds it), or None
    layers_path: str | None
    #: head name -> resolved ``HeadConfig``
    head_configs: Mapping[str, Any]
    #: head name -> ``Head`` module
    heads: nn.ModuleDict
    #: the loss-weighting module (its registered ``name`` and ``config()``)
    loss_weighting: nn.Module
    #: "raise", "skip" or "warn"
    nonfinite_loss: str

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """The heads' (and loss weighting's) tensors under their checkpoint names."""

    def set_loss_weighting(self, name: Any, **options: Any) -> None:
        """Replace the loss-weighting scheme."""

    def get_parameter(self, target: str) -> nn.Parameter: ...

    def get_buffer(self, target: str) -> torch.Tensor: ...

    def eval(self) -> Any: ...

    def requires_grad_(self, requires_grad: bool = True) -> Any: ...
