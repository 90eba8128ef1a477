"""The process group as headkit's multi-process paths see it: which rank this is, and the
few collectives they need.

``current()`` gives (rank, world size) of the default process group, (0, 1) without one.
A process launched as one of several ranks (``torchrun``, ``accelerate launch``: ``WORLD_SIZE``
> 1 in its environment) with no group yet gets the default group initialised from that
environment first, as accelerate's ``PartialState`` does (gloo for CPU tensors, plus NCCL for
CUDA tensors where CUDA is available); the group is left for the caller. Nothing else here
initialises or destroys anything.

The collectives move raw bytes (any dtype, any number of rows per rank) and JSON, never
pickles, and ``agree`` turns one rank's failure into the same error on every rank, so that no
rank waits forever at a collective its failed peer never reaches.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ..errors import BatchError, CheckpointError, ConfigError, HeadkitError


def _dist() -> Any:
    """``torch.distributed`` when this torch has it, else None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() else None


def launched_ranks() -> int:
    """How many ranks the launcher says this process is one of (``WORLD_SIZE``; 1 if unset)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def current(init: bool = True) -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when there is none.

    With ``init`` (the default) a process started by a launcher as one of several ranks
    initialises the default group from the environment when nothing has yet (see module
    docstring)."""
    dist = _dist()
    if dist is None:
        return 0, 1
    if not dist.is_initialized() and init and launched_ranks() > 1:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def is_main() -> bool:
    """Whether this process is rank 0 (or the only process): the one that writes and prints."""
    return current(init=False)[0] == 0


def barrier() -> None:
    """Wait for every rank (nothing without a process group)."""
    dist = _dist()
    if dist is not None and dist.is_initialized():
        dist.barrier()


def _device() -> torch.device:
    """Where the default group's collectives take their tensors: the CPU when its backend
    has a CPU transport (gloo, mpi), else the current accelerator (NCCL, XCCL, ...)."""
    dist = _dist()
    backend = str(dist.get_backend()).lower()
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def gather_bytes(payload: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's 1-D uint8 ``payload`` (any length each), in rank order, on the CPU."""
    dist = _dist()
    device = _device()
    world = dist.get_world_size()
    size = torch.tensor([payload.numel()], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    counts = [int(s) for s in sizes]
    buf = torch.zeros(max(max(counts), 1), dtype=torch.uint8, device=device)
    buf[: payload.numel()] = payload.to(device)
    parts = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(parts, buf)
    return [p[:n].cpu() for p, n in zip(parts, counts)]


def gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of ``t`` concatenated in rank order (dim 0). The ranks' tensors
    share a dtype and the sizes after dim 0; a rank may hold no rows."""
    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    parts = gather_bytes(flat)
    trailing = tuple(t.shape[1:])
    return torch.cat([p.view(t.dtype).reshape(-1, *trailing) for p in parts])


def gather_json(value: Any) -> list[Any]:
    """Every rank's JSON-able ``value``, in rank order."""
    payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    return [json.loads(p.numpy().tobytes().decode()) for p in gather_bytes(payload)]


#: headkit's own error types keep their type when a peer raises them.
_ERRORS: dict[str, type[HeadkitError]] = {
    e.__name__: e for e in (BatchError, CheckpointError, ConfigError, HeadkitError)
}


def agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank when any rank failed at ``what`` (each rank passes its own
    exception, or None). A failed rank re-raises its own; the others raise the first
    failure's type (one of headkit's, else RuntimeError) naming the rank and its message."""
    reports = gather_json(None if error is None else [type(error).__name__, str(error)])
    if error is not None:
        raise error
    for rank, report in enumerate(reports):
        if report is not None:
            kind, message = report
            raise _ERRORS.get(kind, RuntimeError)(f"{what} failed on rank {rank}: {message}")
