"""Reading a torch module on the hot path, without ``parameters()``'s generator machinery.

``module.parameters()`` walks ``named_modules`` through nested generators: about 10 µs for
its first item, which a forward with 25 heads paid 3 times per head. ``first_parameter``
returns the same parameter (``parameters()``'s order: the module's own, then each child's,
depth first) by reading the registries directly; ``has_hooks`` reads the hook registries.
``resolve_device``: the torch device a user names (``headkit.export(..., device=)``,
``--device``), refused when torch does not see it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .errors import ConfigError


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


def has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward or backward hooks of its own (not the global ones)."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    )


def device_of(module: nn.Module, default: torch.device | None = None) -> torch.device:
    """The device of ``module``'s first parameter (``default``, else the CPU, without one)."""
    p = first_parameter(module)
    if p is not None:
        return p.device
    return default if default is not None else torch.device("cpu")


def resolve_device(value: Any, option: str = "device") -> torch.device:
    """The ``torch.device`` a user names: None or "cpu" (the CPU), "auto" (a CUDA GPU when
    torch sees one, else the CPU), a device name ("cuda", "cuda:1", "mps", "xpu") or a
    ``torch.device``. A name torch cannot parse, or a device it does not see here (no such
    backend, or an index past its ``device_count``), is a ConfigError naming ``option``."""
    if value is None or value == "cpu":
        return torch.device("cpu")
    if value == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = value if isinstance(value, torch.device) else torch.device(str(value))
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(
            f"{option}={str(value)[:80]!r} is invalid; allowed: cpu, cuda, cuda:N, mps, xpu, "
            "auto or a torch.device",
            field=option,
            value=value,
        ) from None
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)
    available = backend is not None and backend.is_available()
    index = device.index or 0
    if available and hasattr(backend, "device_count") and index >= backend.device_count():
        available = False
    if not available:
        raise ConfigError(
            f"{option}={str(value)!r}: torch sees no such device here; allowed: cpu, auto",
            field=option,
            value=str(value),
        )
    return device


def on_device(module: nn.Module, device: Any, option: str = "device") -> None:
    """Refuse ``device`` for a model given as an object when it is not where the model is:
    ``device`` says where a checkpoint folder is loaded, and a given model is not moved."""
    if device is None:
        return
    where, wanted = device_of(module), resolve_device(device, option)
    if where.type != wanted.type or (wanted.index or 0) != (where.index or 0):
        raise ConfigError(
            f"{option}={str(device)!r}, but the model given is on {where}: {option} is where a "
            f"checkpoint folder is loaded; a model is used where it is (move it with "
            f"model.to({str(wanted)!r}), or leave {option} out)",
            field=option,
            value=str(device),
        )
