"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with heads: sharding, and saving a
sharded model as an ordinary checkpoint.

``shard(model)`` shards a HeadedModel bottom-up, as FSDP2 wants: each backbone block is a
unit of its own (its parameters gathered just before it runs and freed after), then the
HeadedModel is the root unit, holding everything else — the embeddings, the final norm, the
**heads and the loss weights, which are sharded with the root**: they are small, and the
root's one all-gather before the forward (and one reduce-scatter after the backward) carries
them with the embeddings at no extra collective. The backbone module itself is never a unit:
early exit stops the forward inside it (after the deepest hooked block), which would skip a
unit's post-forward; the blocks' own units finish before the capture hooks stop the forward,
so early exit and the capture hooks work as without FSDP (blocks no head reaches never run
and, with a trainable backbone, are frozen as usual).

``save_pretrained`` on a sharded model — called on **every** rank, as FSDP2 needs — gathers
each sharded parameter (``DTensor.full_tensor()``, one at a time) to the CPU of rank 0, which
writes the ordinary checkpoint with plain tensors in place of the sharded ones (then puts
them back); the other ranks write nothing, and every rank returns once it is written. The
checkpoint loads in one process (``HeadedModel.from_pretrained``), or sharded again: load it
on every rank, then ``shard``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from os import PathLike
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..checkpoint import save_checkpoint
from ..errors import ConfigError
from .ranks import agree, current

if TYPE_CHECKING:
    from ..model.headed import HeadedModel


def shard(model: HeadedModel, mesh: Any = None, **fsdp_kwargs: Any) -> HeadedModel:
    """Shard ``model`` with FSDP2 in place (see module docstring) and return it.

    ``mesh``: a 1-D ``DeviceMesh`` (default: every rank of the default process group, on
    the model's device type); ``fsdp_kwargs`` go to every ``fully_shard`` call
    (``reshard_after_forward``, ``mp_policy``, ``offload_policy``, ...). Needs a process
    group (torchrun or ``accelerate launch`` start one, see ``headkit.distributed.ranks``).
    """
    if not (isinstance(model, nn.Module) and hasattr(model, "head_configs")):
        raise ConfigError(f"shard takes a HeadedModel, got {type(model).__name__}")
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError as e:  # torch built without distributed support
        raise ConfigError(f"shard needs torch.distributed with FSDP2 ({e})") from None
    if isinstance(model, FSDPModule):
        raise ConfigError("the model is sharded already; shard it once")
    _, world = current()
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ConfigError(
            "shard needs a process group: launch with torchrun or accelerate launch (headkit "
            "then starts it), or call torch.distributed.init_process_group() first"
        )
    if mesh is None:
        mesh = init_device_mesh(model.device.type, (world,))
    for block in model.info.layers:
        fully_shard(block, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (sharded by FSDP2 or tensor parallelism)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` as a plain CPU tensor, on rank 0; ``{}`` on the
    other ranks. Every rank must call it (each sharded tensor is gathered in turn)."""
    from torch.distributed.tensor import DTensor

    rank, _ = current(init=False)
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, DTensor):
            value = value.full_tensor()  # a collective: every rank, in the same order
        if rank == 0:
            out[name] = value.detach().cpu()
    return out


@contextmanager
def plain_parameters(model: nn.Module, state: dict[str, torch.Tensor]) -> Iterator[None]:
    """Within the block, each DTensor parameter of ``model`` is replaced by a plain one
    holding ``state``'s tensor of that name (a parameter shared by two modules stays shared);
    the originals are put back on exit."""
    from torch.distributed.tensor import DTensor

    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    plain: dict[int, nn.Parameter] = {}
    try:
        for prefix, module in model.named_modules(remove_duplicate=False):
            for name, p in list(module._parameters.items()):
                if not isinstance(p, DTensor):
                    continue
                key = f"{prefix}.{name}" if prefix else name
                if id(p) not in plain:
                    plain[id(p)] = nn.Parameter(state[key], requires_grad=p.requires_grad)
                swapped.append((module, name, p))
                module._parameters[name] = plain[id(p)]
        yield
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p


def save_sharded(model: HeadedModel, save_directory: str | PathLike, **kwargs: Any) -> None:
    """``save_pretrained`` of a sharded model (see module docstring): every rank calls it,
    rank 0 writes the checkpoint, every rank returns once it is written."""
    state = full_state_dict(model)
    rank, _ = current(init=False)
    error = None
    if rank == 0:
        try:
            with plain_parameters(model, state):
                save_checkpoint(model, save_directory, **kwargs)
        except BaseException as e:  # every rank must hear of it (ranks.agree)
            error = e
    agree(error, f"saving {str(save_directory)!r}")
