"""What distributed data parallel (DDP) needs of a HeadedModel, and what it must not cost.

Two rules:

* **Idle heads.** A head without labels in a step takes no part in its graph, so its
  gradient stays ``None`` and no optimizer moves it (AdamW's weight decay and momentum move
  a parameter whose gradient is an exact zero). DDP copes when it looks for unused
  parameters (``find_unused_parameters=True``: Trainer's default for a HeadedModel, since
  it is not a ``PreTrainedModel``). Inside a DDP forward that does not
  (``find_unused_parameters=False``), every trainable parameter must take part in each
  step, so idle heads join the loss with an exact zero there (``join_idle``), and
  ``drop_idle_gradients`` (called by ``HeadedTrainer`` before each optimizer step) turns
  the zero gradients of heads that were idle on every rank back into ``None``.
* **Blocks no head reaches.** With early exit, the blocks after the deepest hooked layer
  (and the final norm, the pooler, ...) never run, so they can never get a gradient; with a
  trainable backbone they are frozen (``freeze_unreached``), so that DDP without
  ``find_unused_parameters`` works and no optimizer state is kept for them.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ..backbone.inspection import BackboneInfo


def inside_strict_ddp() -> bool:
    """Whether this forward runs inside a DDP forward with ``find_unused_parameters=False``.

    DDP records the module whose forward runs (``_get_active_ddp_module``, for TorchDynamo).
    Where that record is unavailable, an initialised process group of more than one rank
    counts as strict (the safe answer: joining idle heads never breaks DDP).
    """
    try:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
    except ImportError:  # torch built without distributed support
        return False
    active = getattr(DDP, "_get_active_ddp_module", None)
    if active is not None:
        ddp = active()
        if ddp is not None:
            return not getattr(ddp, "find_unused_parameters", True)
        if getattr(DDP, "_active_ddp_module", "missing") is None:
            return False  # the record exists and says: not inside a DDP forward
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def join_idle(
    model: Any,
    loss: torch.Tensor | None,
    preds: dict[str, torch.Tensor],
    used: set[str],
) -> torch.Tensor | None:
    """``loss`` plus an exact zero from every trainable head not in ``used`` and from the loss
    weighting's parameters, so that each takes part in the graph (``nan_to_num`` keeps the
    zero exact even for non-finite predictions). The joined heads are remembered until
    ``drop_idle_gradients``."""
    idle = {n: p for n, p in preds.items() if n not in used and p.requires_grad}
    terms = list(idle.values()) + [p for p in model.loss_weighting.parameters() if p.requires_grad]
    if not terms:
        return loss
    model.__dict__.setdefault("_joined_idle", set()).update(idle)
    zero = sum((t * 0.0).nan_to_num(0.0, 0.0, 0.0).sum() for t in terms)
    return zero if loss is None else loss + zero


@torch.no_grad()
def drop_idle_gradients(model: Any) -> list[str]:
    """Set to None the gradients that only an idle-head join gave (exact zeros: the head had
    no labels on any rank since the last optimizer step), so that the optimizer leaves those
    heads untouched; return their names. ``HeadedTrainer`` calls it before each optimizer
    step; a custom DDP loop with ``find_unused_parameters=False`` calls it before
    ``optimizer.step()``."""
    joined = model.__dict__.pop("_joined_idle", set())
    dropped = []
    for name in sorted(joined):
        params = [p for p in model.heads[name].parameters() if p.grad is not None]
        if params and not any(bool(p.grad.any()) for p in params):
            for p in params:
                p.grad = None
            dropped.append(name)
    if joined:
        for p in model.loss_weighting.parameters():
            if p.grad is not None and not bool(p.grad.any()):
                p.grad = None
    return dropped


def unreached_modules(backbone: nn.Module, info: BackboneInfo, deepest: int) -> list[str]:
    """Names of the backbone's direct parts that never run when the forward stops after
    hidden state ``deepest``: blocks ``deepest..L-1`` and whatever is registered after the
    block stack (final norm, pooler), found by the stack's place among the modules."""
    names = [f"{info.layers_path}.{i}" for i in range(deepest, info.num_layers)]
    stack_path = info.layers_path.split(".")
    parent = backbone.get_submodule(".".join(stack_path[:-1])) if len(stack_path) > 1 else backbone
    prefix = ".".join(stack_path[:-1])
    after = False
    for child_name, child in parent.named_children():
        if child is info.layers:
            after = True
            continue
        if after and any(p.numel() for p in child.parameters()):
            names.append(f"{prefix}.{child_name}" if prefix else child_name)
    if len(stack_path) > 1:  # e.g. BERT: encoder.layer → the pooler beside the encoder
        top = backbone.get_submodule(stack_path[0])
        after = False
        for child_name, child in backbone.named_children():
            if child is top:
                after = True
                continue
            if after and any(p.numel() for p in child.parameters()):
                names.append(child_name)
    return names


def freeze_unreached(model: Any) -> list[str]:
    """Freeze the trainable backbone parts that early exit never runs; return their names.

    Applies when the model exits early (no head reads the last hidden state); warns once,
    naming how many blocks were frozen. A head on layer -1 keeps every block trainable.
    """
    info: BackboneInfo = model.info
    hooks = set(model.hooked_layers().values())
    if not model.early_exit or not hooks or (info.num_layers in hooks and info.tie_last):
        return []
    if info.decoder is not None or max(hooks) > info.num_layers:
        return []  # heads on a decoder run the whole encoder; last_hidden_state: every block
    deepest = max(hooks)
    pools = any("pooler" in c.pooling_strategies for c in model.head_configs.values())
    frozen = []
    for name in unreached_modules(model.backbone, info, deepest):
        module = model.backbone.get_submodule(name)
        if pools and module is info.pooler:
            continue  # heads pooling with it run it on their hooked states
        params = [p for p in module.parameters() if p.requires_grad]
        if params:
            for p in params:
                p.requires_grad_(False)
            frozen.append(name)
    if frozen:
        blocks = sum(1 for n in frozen if n.startswith(f"{info.layers_path}."))
        others = [n for n in frozen if not n.startswith(f"{info.layers_path}.")]
        also = f" and {', '.join(others)}" if others else ""
        warnings.warn(
            f"HeadedModel: the deepest head reads hidden state {deepest} of {info.num_layers}, "
            f"so {blocks} block(s) after it{also} never run (early exit) and can get no "
            "gradient: frozen (requires_grad=False), so DDP needs no find_unused_parameters. "
            "Put a head on layer_hook=-1 to train them.",
            stacklevel=3,
        )
    return frozen
