"""Where each head lives: on the device of what produces the hidden state it reads.

A model loaded with a ``device_map`` spanning devices (accelerate's big-model dispatch) runs
each block on its own device, and ``from_pretrained`` records where in ``hf_device_map``
(module name → device). A head reading hidden state ``k`` is built on the device that state
comes out on: the input embeddings' for ``k = 0`` (the first block's input), block ``k-1``'s
for ``k >= 1``, and, for the last hidden state when it is the model's output
(``last_hidden_state``, after a final norm), the final norm's. Its pooling and loss run there
(masks and labels are moved to it; a head that shares the input embeddings' matrix, a tied
LM head, gets the state moved to that matrix's device); the total loss is gathered on the
first head's device, where the loss weighting lives. Without a device map every head goes
to the device of the backbone's first parameter.

Map entries follow accelerate's dispatch: an integer is an accelerator index, a module
offloaded to "cpu" or "disk" runs on the main device (the map's first accelerator; the CPU
when it has none), a module without an entry runs where its closest parent's entry says, and
a module split over several entries hands on its output from its last one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..backbone.inspection import BackboneInfo, path_of
from ..modules import device_of, first_parameter

_OFFLOADED = ("cpu", "disk")


def as_device(value: Any) -> torch.device:
    """A device map's value as a torch device (an integer is an accelerator index)."""
    if isinstance(value, torch.device):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        accelerator = torch.accelerator.current_accelerator()
        return torch.device(accelerator.type if accelerator is not None else "cuda", value)
    return torch.device(str(value))


def execution_device(device_map: Mapping[str, Any], module: str) -> torch.device | None:
    """The device ``module`` (a dotted name in the map's model) runs on under ``device_map``
    (see module docstring); None when the map says nothing about it."""
    main = next((v for v in device_map.values() if str(v) not in _OFFLOADED), "cpu")
    own = [k for k in device_map if k == "" or module == k or module.startswith(k + ".")]
    if own:
        value = device_map[max(own, key=len)]
    else:
        parts = [v for k, v in device_map.items() if k.startswith(module + ".")]
        if not parts:
            return None
        value = parts[-1]
    return as_device(main if str(value) in _OFFLOADED else value)


def producers(backbone: nn.Module, info: BackboneInfo, layer: int) -> list[str]:
    """Names (in the backbone) of the modules whose output is hidden state ``layer``, the
    most specific first: the final norm (last state of a ``tie_last`` model), the block
    before it, or the input embeddings for state 0."""
    names = {id(m): n for n, m in backbone.named_modules()}
    if layer == 0:
        embeddings = (
            backbone.get_input_embeddings() if hasattr(backbone, "get_input_embeddings") else None
        )
        if embeddings is not None and id(embeddings) in names:
            return [names[id(embeddings)]]
        return [f"{info.layers_path}.0"]  # (no embeddings to ask: the first block's device)
    block = f"{info.layers_path}.{layer - 1}"
    if layer < info.num_layers or not info.tie_last:
        return [block]
    stack = info.layers_path.split(".")
    parent = backbone.get_submodule(".".join(stack[:-1])) if len(stack) > 1 else backbone
    prefix = ".".join(stack[:-1])
    after, norms = False, []
    for child_name, child in parent.named_children():
        if child is info.layers:
            after = True
        elif after and any(True for _ in child.parameters()):
            norms.append(f"{prefix}.{child_name}" if prefix else child_name)
            break  # the first part with weights after the block stack: its final norm
    return norms + [block]


def head_devices(
    model: nn.Module,
    backbone: nn.Module,
    info: BackboneInfo,
    layer_of_head: Mapping[str, Any],
    default: torch.device,
) -> dict[str, torch.device]:
    """Each head's device from ``model.hf_device_map`` (``model`` is what was loaded: the
    backbone or a task model holding it), by the state it reads (a hidden-state index, or
    a ``StateKey``); ``default`` without a map
    or where the map names none of the producing modules."""
    device_map = getattr(model, "hf_device_map", None)
    if not isinstance(device_map, Mapping) or not device_map:
        return dict.fromkeys(layer_of_head, default)
    prefix = path_of(model, backbone)
    out = {}
    for head, key in layer_of_head.items():
        # past the last block (last_hidden_state), the final norm produces it
        stack = info.stack_info(key.stack)
        layer = min(key.index, stack.num_layers)
        device = None
        for name in producers(backbone, stack, layer):
            device = execution_device(device_map, f"{prefix}.{name}" if prefix else name)
            if device is not None:
                break
        out[head] = device if device is not None else default
    return out


def on_device_of(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` on the device of ``head``'s first parameter (a head sharing the input
    embeddings' matrix, a tied LM head, lives where that matrix does)."""
    p = first_parameter(head)
    return hidden if p is None or hidden.device == p.device else hidden.to(p.device)


def loss_device(heads: nn.Module, default: torch.device) -> torch.device:
    """Where the total loss is gathered: the first head's device (``default`` without one)."""
    return device_of(heads, default)
