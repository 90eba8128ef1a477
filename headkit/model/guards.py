"""Checks on the hot path that never stall an accelerator's queue.

Reading a tensor's value on the host (``bool(t.any())``, ``int(t.max())``, ``.item()``)
waits for every kernel queued before it. On the CPU that costs nothing, so every check runs
on every batch. On an accelerator:

- **value checks** of a batch (token ids in the vocabulary, mask values, positions, class
  indices, finite labels) run until a batch of each *signature* (the names, shapes, dtypes
  and devices of the inputs and labels) has passed them (``ValueChecks.due`` / ``passed``);
  later batches of that signature only get the checks that need no read (a bad value there
  meets the backbone or the loss: on CUDA a device-side assert, not a headkit error).
  ``check_inputs=False`` skips the checks altogether.
- **the non-finite loss guard** (``nonfinite_loss="raise"``) on CUDA copies the step's
  losses to pinned host memory without waiting and reads them at the next forward, once
  the copy has landed: the error comes one step late and names the head, and nothing
  waits. ``"skip"`` must know at once which losses to leave out, so it reads them on every
  device. Inside ``torch.compile`` a graph cannot branch on values: the losses come back as
  computed (a non-finite loss stays visible in the logged loss) and the guard reads nothing.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import NonFiniteLossError

#: A forward waits for the oldest unread flags when more are queued than this.
MAX_PENDING = 8
#: Signatures remembered per model; more than this starts the memory afresh.
MAX_SIGNATURES = 4096


def compiling() -> bool:
    """True while torch.compile traces (no host reads, no hooks added there)."""
    return bool(torch.compiler.is_compiling())


class ValueChecks:
    """Which batches get the value checks: every one on the CPU, the first of each
    signature elsewhere (see module docstring)."""

    #: Device types whose batches are all checked (reading their values costs nothing).
    every_batch_devices: tuple[str, ...] = ("cpu", "meta")

    def __init__(self) -> None:
        self._seen: set[tuple] = set()

    def due(self, tensors: Mapping[str, Any]) -> tuple | None:
        """The batch's signature when its values should be checked on the host now (pass it
        to ``passed`` once they were), else None."""
        if compiling():
            return None
        key = tuple(
            (k, tuple(v.shape), v.dtype, v.device)
            for k, v in sorted(tensors.items())
            if isinstance(v, torch.Tensor)
        )
        return None if key in self._seen else key

    def passed(self, key: tuple | None) -> None:
        """Record that a batch of signature ``key`` passed the checks: off the CPU, later
        batches of that signature are not read again."""
        if key is None or all(d[3].type in self.every_batch_devices for d in key):
            return
        if len(self._seen) >= MAX_SIGNATURES:
            self._seen.clear()
        self._seen.add(key)

    def __deepcopy__(self, memo: dict) -> ValueChecks:
        return ValueChecks()


@dataclass
class _Pending:
    names: list[str]  # the heads, then "" for the total
    values: torch.Tensor  # pinned host copy, filled when ``event`` completes
    event: Any  # torch.cuda.Event


class NonFiniteGuard:
    """Raise on, or leave out, a head loss that is NaN or infinite (module docstring)."""

    #: Device types whose losses ``"raise"`` reads one step late, without waiting.
    deferred_devices: tuple[str, ...] = ("cuda",)

    def __init__(self) -> None:
        self._pending: deque[_Pending] = deque()

    def __deepcopy__(self, memo: dict) -> NonFiniteGuard:
        return NonFiniteGuard()

    def __getstate__(self) -> dict:
        return {"_pending": deque()}

    def check_pending(self, wait: bool = False) -> None:
        """Read the flags of earlier steps whose copy has landed (all of them, waiting, with
        ``wait=True``); raise NonFiniteLossError for a non-finite one."""
        while self._pending:
            p = self._pending[0]
            if not p.event.query():
                if not wait and len(self._pending) <= MAX_PENDING:
                    return
                p.event.synchronize()
            self._pending.popleft()
            values = p.values.tolist()
            bad = [n for n, v in zip(p.names, values) if not math.isfinite(v)]
            if bad:
                self._pending.clear()
                raise NonFiniteLossError(_late_message(p.names, values, bad[0]))

    def combine(
        self,
        losses: dict[str, torch.Tensor],
        weighting: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
        policy: str,
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """The weighted total and the adapted losses by head, guarded by ``policy``."""
        if not losses:
            return None, {}
        device = next(iter(losses.values())).device
        if compiling() or (policy == "raise" and device.type in self.deferred_devices):
            adapted = weighting(losses)
            total = sum(adapted.values())
            if not compiling():
                self._defer(losses, total)
            return total, adapted
        stacked = torch.stack([v.detach().float().reshape(()) for v in losses.values()])
        all_finite = bool(torch.isfinite(stacked).all())  # one read for every head
        for name, value in list(losses.items()) if not all_finite else []:
            if not bool(torch.isfinite(value).all()):
                if policy == "raise":
                    raise NonFiniteLossError(
                        f"head {name!r} produced a non-finite loss ({float(value.detach())}); pass "
                        "nonfinite_loss='skip' to HeadedModel to leave such losses out"
                    )
                warnings.warn(f"head {name!r}: non-finite loss skipped", stacklevel=4)
                losses = {k: v for k, v in losses.items() if k != name}
        adapted = weighting(losses)
        total = sum(adapted.values()) if adapted else None
        if total is not None and not bool(torch.isfinite(total).all()):
            parts = ", ".join(f"{n}: {float(v.detach()):g}" for n, v in adapted.items())
            if policy == "raise":
                raise NonFiniteLossError(
                    f"the total loss of heads {sorted(adapted)} is non-finite "
                    f"({float(total.detach())}) although each head's loss is finite (weighted: "
                    f"{parts}); lower their loss_weight, or pass nonfinite_loss='skip' to "
                    "HeadedModel to skip such steps"
                )
            warnings.warn(
                f"heads {sorted(adapted)}: non-finite total loss ({parts}); step skipped",
                stacklevel=4,
            )
            return None, adapted
        return total, adapted

    def _defer(self, losses: dict[str, torch.Tensor], total: torch.Tensor) -> None:
        """Queue a copy of this step's losses to pinned host memory (no wait)."""
        stacked = torch.stack([v.detach().float().reshape(()) for v in losses.values()])
        stacked = torch.cat([stacked, total.detach().float().reshape(1)])
        if stacked.device.type == "cuda":
            host = torch.empty(stacked.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            event: Any = torch.cuda.Event()
            event.record()
        else:  # (another deferred device type: a plain copy, already complete)
            host, event = stacked.cpu(), _Landed()
        self._pending.append(_Pending([*losses, ""], host, event))


class _Landed:
    """The event of a copy that has completed."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def _late_message(names: list[str], values: list[float], bad: str) -> str:
    where = f"head {bad!r} produced" if bad else f"the total loss of heads {names[:-1]} was"
    parts = ", ".join(f"{n or 'total'}: {v:g}" for n, v in zip(names, values))
    return (
        f"{where} a non-finite loss in an earlier step ({parts}); on CUDA the guard reads "
        "the losses one step late so as not to stall the GPU, so that step's update has been "
        "applied: reload the last good checkpoint, or pass nonfinite_loss='skip' to "
        "HeadedModel to leave such losses out (read at once)"
    )
