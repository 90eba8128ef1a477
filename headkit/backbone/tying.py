"""Head weights tied to the backbone's input embeddings (a frozen ``lm_head`` of a tied model).

When a model ties its LM head to its input embeddings (GPT-2, SmolLM2, Gemma, ...), a frozen
``lm_head`` head shares that very ``Parameter`` instead of holding a copy: memory stays that of
the bare model. Checkpoints record such a weight by name (``tied_to_input_embeddings`` in the
manifest) and never write it; restoring ties it again to whatever embeddings the backbone has
(referenced or saved). A trainable head gets a real copy, which is saved like any weight.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import CheckpointError
from ..heads.base import Head
from .modalities import lm_logits_rule

if TYPE_CHECKING:
    from ..config import HeadConfig


def input_embedding_weight(backbone: nn.Module) -> nn.Parameter | None:
    """The backbone's input embedding matrix (vocab, hidden), or None if it has none."""
    try:
        emb = backbone.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    weight = getattr(emb, "weight", None)
    return weight if isinstance(weight, nn.Parameter) else None


@torch.no_grad()
def init_lm_head(
    heads: nn.Module,
    configs: Mapping[str, HeadConfig],
    backbone: nn.Module,
    task_model: nn.Module,
    frozen_backbone: bool,
) -> None:
    """Start an ``lm_head`` causal-LM head from ``task_model``'s LM head.

    Only a head that is nothing but its output projection (``Head.projection_only``: a
    one-layer MLP head) of the LM head's shape starts there. A frozen one, on a frozen backbone
    that ties its LM head to its input embeddings, shares that matrix (no copy); otherwise the
    head gets a copy (and the bias, or zeros). What the task model adds around its LM head is
    folded in (``modalities.lm_logits_rule``): T5's scaling of the states into the weight,
    BART's ``final_logits_bias`` into the head's bias (a head without one warns when it is
    not zero). A frozen head (``trainable=False``) takes the LM head's dtype, so that in
    bfloat16 or float16 its logits are the task model's own; a trainable one keeps its
    parameters' (float32 unless the model was converted).
    """
    cfg = configs.get("lm_head")
    if cfg is None or not cfg.is_causal_lm:
        return
    head = heads["lm_head"]
    lin = head.output_projection() if isinstance(head, Head) and head.projection_only else None
    out = task_model.get_output_embeddings()
    if lin is None or not isinstance(out, nn.Linear) or out.weight.shape != lin.weight.shape:
        return
    if not cfg.trainable:  # a frozen head computes as the task model does: in its dtype
        head.to(out.weight.dtype)
    emb = input_embedding_weight(backbone)
    scale, extra_bias = lm_logits_rule(task_model)
    same_dtype = lin.bias is None or lin.bias.dtype == out.weight.dtype
    if out.weight is emb and not cfg.trainable and frozen_backbone and same_dtype and scale == 1:
        lin.weight = emb
    else:
        lin.weight.copy_(out.weight * scale if scale != 1 else out.weight)
    if lin.bias is not None:
        if out.bias is not None:
            lin.bias.copy_(out.bias)
        else:
            lin.bias.zero_()
        if extra_bias is not None:
            lin.bias.add_(extra_bias.reshape(-1).to(lin.bias.dtype))
    elif extra_bias is not None and bool(extra_bias.any()):
        warnings.warn(
            f"{type(task_model).__name__} adds final_logits_bias to its LM head's logits; head "
            "'lm_head' has no bias to hold it (HeadConfig(..., output_bias=True) reproduces "
            "the model's logits exactly)",
            stacklevel=3,
        )


def tied_head_weights(backbone: nn.Module, heads: nn.Module, prefix: str = "heads.") -> list[str]:
    """Names (``prefix`` + parameter path) of head parameters that are the input embeddings."""
    emb = input_embedding_weight(backbone)
    if emb is None:
        return []
    return [prefix + n for n, p in heads.named_parameters(remove_duplicate=False) if p is emb]


def tie_head_weights(
    backbone: nn.Module,
    heads: nn.Module,
    names: Iterable[str],
    trainable: dict[str, bool],
    where: str = "checkpoint",
    prefix: str = "heads.",
) -> None:
    """Make exactly ``names`` tied: each becomes the input embeddings (a frozen head) or a copy
    of them (a head whose ``trainable[head]`` is True); any other tied weight gets a copy."""
    emb = input_embedding_weight(backbone)
    wanted = set(names)
    for name in sorted(wanted | set(tied_head_weights(backbone, heads, prefix))):
        module, attr, head = _owner(heads, name, prefix, where)
        current, learns = getattr(module, attr), trainable.get(head, False)
        if name not in wanted:  # tied in the model, stored in the checkpoint: a copy to load into
            setattr(module, attr, nn.Parameter(emb.detach().clone(), requires_grad=learns))
            continue
        if emb is None or tuple(emb.shape) != tuple(current.shape):
            shape = None if emb is None else tuple(emb.shape)
            raise CheckpointError(
                f"{where}: {name!r} is tied to the input embeddings, but the backbone's are "
                f"{shape} and the head expects {tuple(current.shape)}"
            )
        if not learns:
            setattr(module, attr, emb)
        elif current is emb:  # a trainable head learns on its own copy
            setattr(module, attr, nn.Parameter(emb.detach().clone(), requires_grad=True))
        else:
            with torch.no_grad():
                current.copy_(emb)


def _owner(heads: nn.Module, name: str, prefix: str, where: str) -> tuple[nn.Module, str, str]:
    """(module, attribute, head name) of a parameter named ``prefix`` + path."""
    path = name.removeprefix(prefix)
    owner_path, _, attr = path.rpartition(".")
    try:
        module = heads.get_submodule(owner_path)
    except AttributeError:
        module = None
    if module is None or not isinstance(getattr(module, attr, None), nn.Parameter):
        raise CheckpointError(f"{where}: tied weight {name!r} names no parameter of the heads")
    return module, attr, path.split(".", 1)[0]
