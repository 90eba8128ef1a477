"""Reading a torch module on the hot path, without ``parameters()``'s generator machinery.

``module.parameters()`` walks ``named_modules`` through nested generators: about 10 µs for
its first item, which a forward with 25 heads paid 3 times per head. ``first_parameter``
returns the same parameter (``parameters()``'s order: the module's own, then each child's,
depth first) by reading the registries directly.
"""

from __future__ import annotations

import torch
from torch import nn


def first_parameter(module: nn.Module) -> nn.Parameter | None:
    """``next(module.parameters(), None)``, without the generators."""
    for p in module._parameters.values():
        if p is not None:
            return p
    for child in module._modules.values():
        if child is not None:
            p = first_parameter(child)
            if p is not None:
                return p
    return None


def device_of(module: nn.Module, default: torch.device | None = None) -> torch.device:
    """The device of ``module``'s first parameter (``default``, else the CPU, without one)."""
    p = first_parameter(module)
    if p is not None:
        return p.device
    return default if default is not None else torch.device("cpu")
