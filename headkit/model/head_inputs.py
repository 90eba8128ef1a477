"""Where each head reads: its config resolved against the backbone, its state and its mask.

A head reads one captured state, a ``StateKey(stack, index)``: its stack ("encoder": the
model's only stack or an encoder–decoder model's encoder; "decoder") and the index into that
stack's ``hidden_states`` (``num_layers + 1`` for ``last_hidden_state=True`` where HF's
``hidden_states[-1]`` is taken before the final norm). Its mask is its stack's (the
attention mask, a speech model's frame mask, none for images, the decoder's mask), narrowed
to text or image tokens by ``pool_over``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from transformers import PreTrainedModel

from ..backbone.inputs import BackboneInputs
from ..backbone.inspection import BackboneInfo, StateKey
from ..backbone.modalities import default_pooling, image_token_ids, pool_over_mask
from ..config import HeadConfig
from ..distributed.placement import on_device_of
from ..errors import BatchError, ConfigError
from ..heads.base import Head


def resolve_config(info: BackboneInfo, backbone: PreTrainedModel, cfg: HeadConfig) -> HeadConfig:
    """Fill the fields that depend on the backbone and check them against it."""
    stack = info.stack_info(cfg.stack)
    changes: dict[str, Any] = {}
    if cfg.in_size is None:
        changes["in_size"] = info.hidden_size
    elif cfg.in_size != info.hidden_size:
        raise ConfigError(
            f"HeadConfig(name={cfg.name!r}): in_size={cfg.in_size} does not match the width "
            f"of the hooked layer {cfg.layer_hook} ({info.hidden_size}, the backbone's "
            "hidden size)"
        )
    if cfg.num_outputs is None:
        if cfg.is_causal_lm and info.vocab_size is None:
            raise ConfigError(f"HeadConfig(name={cfg.name!r}): num_outputs=None needs a vocab")
        changes["num_outputs"] = info.vocab_size if cfg.is_causal_lm else 1
    if cfg.pred_for_sequence and cfg.pooling is None:
        changes["pooling"] = default_pooling(info.modality, stack.is_decoder, info.has_cls)
    if cfg.is_causal_lm and not stack.is_decoder:
        warnings.warn(
            f"head {cfg.name!r} is a causal-LM head on a bidirectional backbone "
            f"({type(backbone).__name__}{' encoder' if info.encoder_decoder else ''}): every "
            "position sees its next token",
            stacklevel=4,
        )
    cfg = cfg.replace(**changes) if changes else cfg
    if "pooler" in cfg.pooling_strategies and (info.pooler is None or stack is not info):
        raise ConfigError(
            f"HeadConfig(name={cfg.name!r}): pooling={cfg.pooling!r} needs the backbone's "
            f"pooler, but {type(backbone).__name__} has none; use 'first', 'mean', ..."
        )
    if "patch_mean" in cfg.pooling_strategies and info.modality != "vision":
        raise ConfigError(
            f"HeadConfig(name={cfg.name!r}): pooling={cfg.pooling!r} averages the image "
            f"patches of a vision backbone, but {type(backbone).__name__} is a "
            f"{info.modality} model; use 'mean'"
        )
    if cfg.pool_over != "all" and not image_token_ids(backbone.config):
        raise ConfigError(
            f"HeadConfig(name={cfg.name!r}): pool_over={cfg.pool_over!r} needs a "
            f"vision-language model with image tokens; {type(backbone).__name__} has none "
            "(its config sets no image_token_id): use pool_over='all'"
        )
    return cfg


def state_key(info: BackboneInfo, cfg: HeadConfig) -> StateKey:
    """The captured state ``cfg`` reads (see the module docstring)."""
    stack = info.stack_info(cfg.stack)
    index = stack.resolve_hook(cfg.layer_hook, cfg.name)
    if cfg.last_hidden_state and not stack.tie_last:
        index = stack.num_layers + 1
    return StateKey(stack.stack, index)


def reached_blocks(info: BackboneInfo, keys: Iterable[StateKey]) -> list[tuple[str, list]]:
    """(the path of a block stack, its blocks that run) for heads reading ``keys``: each
    stack up to its deepest state read (all of it for ``last_hidden_state``); an
    encoder–decoder model's whole encoder when a head reads its decoder."""
    keys = list(keys)
    decoder = [k.index for k in keys if k.on_decoder]
    encoder = [k.index for k in keys if not k.on_decoder]
    if decoder:
        dec = info.decoder
        return [
            (info.layers_path, list(info.layers)),
            (dec.layers_path, list(dec.layers)[: max(decoder)]),
        ]
    return [(info.layers_path, list(info.layers)[: max(encoder, default=0)])]


def head_masks(
    configs: Mapping[str, HeadConfig],
    keys: Mapping[str, StateKey],
    inputs: BackboneInputs,
    backbone: PreTrainedModel,
) -> dict[str, torch.Tensor | None]:
    """Each head's mask over the positions of the state it reads (None: all count)."""
    out: dict[str, torch.Tensor | None] = {}
    restricted: dict[tuple, torch.Tensor | None] = {}  # (stack, pool_over) → mask, built once
    for name, cfg in configs.items():
        mask = inputs.decoder_mask if keys[name].on_decoder else inputs.mask
        if cfg.pool_over != "all":
            if inputs.input_ids is None:
                raise BatchError(
                    f"head {name!r} pools over {cfg.pool_over} tokens (pool_over="
                    f"{cfg.pool_over!r}), which are read from input_ids; pass input_ids, "
                    "not inputs_embeds"
                )
            key = (keys[name].stack, cfg.pool_over)
            if key not in restricted:
                ids = image_token_ids(backbone.config)
                restricted[key] = pool_over_mask(mask, inputs.input_ids, ids, cfg.pool_over)
            mask = restricted[key]
        out[name] = mask
    return out


def mask_of(mask: torch.Tensor | Mapping[str, Any] | None, head: str) -> torch.Tensor | None:
    """A head's mask from one mask for all heads or a mapping of them by head name."""
    return mask.get(head) if isinstance(mask, Mapping) else mask


def head_inputs(
    heads: Mapping[str, Any],
    keys: Mapping[str, Any],
    captured: dict,
    mask: torch.Tensor | Mapping[str, Any] | None,
) -> dict[str, torch.Tensor]:
    """Each head's input from the hooked states ``captured`` (each head reads
    ``captured[keys[name]]``, moved to the head's device where it sits elsewhere,
    ``placement.py``); a parameter-free pooling is computed once per (state, positions,
    device, pooling) and shared by the heads that ask for it. ``mask``: one for all heads, or
    each head's (``head_masks``). ``HeadedModel.forward`` and the ONNX graph both call it."""
    shared: dict[tuple, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, head in heads.items():
        layer = keys[name]
        hidden = on_device_of(head, captured[layer])
        key = head.pooling_key if isinstance(head, Head) else None
        if key is None:
            out[name] = head.features(hidden, mask_of(mask, name))
            continue
        key = (layer, getattr(head.config, "pool_over", "all"), hidden.device, *key)
        if key not in shared:
            shared[key] = head.features(hidden, mask_of(mask, name))
        out[name] = shared[key]
    return out
