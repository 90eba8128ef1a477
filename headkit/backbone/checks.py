"""Checks of a batch's model inputs: token ids, masks, embeddings, images and audio.

Each malformed input is a BatchError naming the field, the value and what is allowed, raised
before the backbone runs (``inputs.prepare_inputs`` calls these).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import PreTrainedModel

from ..errors import BatchError
from .inspection import BackboneInfo
from .modalities import num_frames


def _int_ids(name: str, value: Any, shape: tuple[int, ...] | None) -> None:
    """``value`` must be an integer (not bool) tensor; of ``shape`` when given."""
    if not isinstance(value, torch.Tensor):
        raise BatchError(
            f"{name} must be a torch.Tensor, got {type(value).__name__}; "
            "use tokenizer(..., return_tensors='pt')"
        )
    if value.dtype not in (torch.int64, torch.int32):  # what embedding lookups accept
        raise BatchError(
            f"{name} must hold integer ids of dtype torch.int64 or torch.int32, got {value.dtype}"
        )
    if shape is not None and tuple(value.shape) != shape:
        raise BatchError(
            f"{name} of shape {tuple(value.shape)} does not match the inputs; expected {shape}"
        )


def input_embeddings(backbone: PreTrainedModel) -> Any:
    """The backbone's input embeddings module (None where it has none)."""
    try:
        return backbone.get_input_embeddings()
    except (NotImplementedError, AttributeError):  # exotic models: skip the width/vocab checks
        return None


def check_inputs(
    backbone: PreTrainedModel,
    input_ids: Any,
    inputs_embeds: Any,
    attention_mask: Any,
    position_ids: Any,
    token_type_ids: Any,
    past: int = 0,
    prefix: str = "",
) -> None:
    """Raise BatchError naming the field, value and what is allowed for malformed inputs
    (``prefix``: "decoder_" for an encoder–decoder model's decoder inputs)."""
    ids_name, embeds_name = f"{prefix}input_ids", f"{prefix}inputs_embeds"
    if input_ids is not None and inputs_embeds is not None:
        raise BatchError(f"pass {ids_name} or {embeds_name}, not both")
    if input_ids is None and inputs_embeds is None:
        raise BatchError(f"the batch needs {ids_name} or {embeds_name}")
    emb = input_embeddings(backbone)
    if input_ids is not None:
        _int_ids(ids_name, input_ids, None)
        ref = input_ids
    else:
        if not isinstance(inputs_embeds, torch.Tensor) or not inputs_embeds.is_floating_point():
            raise BatchError(
                f"{embeds_name} must be a floating-point torch.Tensor, got "
                f"{getattr(inputs_embeds, 'dtype', type(inputs_embeds).__name__)}"
            )
        ref = inputs_embeds
    want_dim = 2 if input_ids is not None else 3
    if ref.dim() != want_dim or ref.shape[0] == 0 or ref.shape[1] == 0:
        what = ids_name if input_ids is not None else embeds_name
        expected = "2-D (batch >= 1, seq >= 1)" if want_dim == 2 else "3-D (batch, seq, hidden)"
        raise BatchError(
            f"empty or malformed batch: {what} of shape {tuple(ref.shape)}; expected {expected}"
        )
    width = getattr(emb, "embedding_dim", None)
    if inputs_embeds is not None and width is not None and inputs_embeds.shape[-1] != width:
        raise BatchError(
            f"{embeds_name} of width {inputs_embeds.shape[-1]} do not match the backbone's "
            f"embedding width {width}"
        )
    vocab = getattr(emb, "num_embeddings", None)
    if input_ids is not None and vocab is not None and input_ids.device.type != "meta":
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab:
            raise BatchError(
                f"{ids_name} holds token id {lo if lo < 0 else hi}, outside the vocabulary; "
                f"allowed: 0..{vocab - 1} (the backbone's input embeddings have {vocab} rows)"
            )
    batch_seq = tuple(ref.shape[:2])
    _check_mask(attention_mask, batch_seq, past, f"{prefix}attention_mask")
    if token_type_ids is not None:
        _int_ids("token_type_ids", token_type_ids, batch_seq)
    if position_ids is not None:
        _int_ids(f"{prefix}position_ids", position_ids, None)
        if position_ids.shape not in (batch_seq, (1, batch_seq[1])):
            raise BatchError(
                f"{prefix}position_ids of shape {tuple(position_ids.shape)} does not match the "
                f"inputs; expected {batch_seq} or {(1, batch_seq[1])}"
            )


def check_signal(
    backbone: PreTrainedModel,
    info: BackboneInfo,
    batch: Mapping[str, Any],
    value: Any,
    attention_mask: Any,
) -> None:
    """Raise BatchError for malformed images or audio: a floating tensor of the model's
    layout (``pixel_values`` (batch, channels, height, width), ``input_values`` (batch,
    samples), ``input_features`` (batch, mel bins, frames)), and no token inputs."""
    name, model = info.main_input, type(backbone).__name__
    names = ("input_ids", "inputs_embeds", "token_type_ids")
    tokens = [k for k in names if batch.get(k) is not None]
    if tokens and tokens[0] not in info.forward_params:
        raise BatchError(f"{model} takes {name}, not {tokens[0]}; pass {name}=...")
    if value is None:
        raise BatchError(f"the batch needs {name} ({model}'s input)")
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise BatchError(
            f"{name} must be a floating-point torch.Tensor, got "
            f"{getattr(value, 'dtype', type(value).__name__)}; use the model's processor "
            "with return_tensors='pt'"
        )
    layout = {"pixel_values": 4, "input_values": 2, "input_features": 3}[name]
    what = {
        "pixel_values": "(batch, channels, height, width)",
        "input_values": "(batch, samples)",
        "input_features": "(batch, mel bins, frames)",
    }[name]
    if value.dim() != layout or 0 in value.shape:
        raise BatchError(f"{name} of shape {tuple(value.shape)}; expected {what}, none empty")
    config = backbone.config
    channels = getattr(config, "num_channels", None) if name == "pixel_values" else None
    channels = getattr(config, "num_mel_bins", None) if name == "input_features" else channels
    if isinstance(channels, int) and value.shape[1] != channels:
        field = "num_channels" if name == "pixel_values" else "num_mel_bins"
        raise BatchError(
            f"{name} of shape {tuple(value.shape)} has {value.shape[1]} at dim 1, but the "
            f"model's config has {field}={channels}"
        )
    size = getattr(config, "image_size", None)
    interpolates = batch.get("interpolate_pos_encoding") or "interpolate_pos_encoding" not in (
        info.forward_params
    )
    other_size = isinstance(size, int) and tuple(value.shape[2:]) != (size, size)
    if name == "pixel_values" and other_size and not interpolates:
        raise BatchError(
            f"pixel_values of {tuple(value.shape[2:])} pixels; {model} takes {size}x{size} "
            "(image_size), or pass interpolate_pos_encoding=True"
        )
    if name == "input_values":
        _check_mask(attention_mask, tuple(value.shape), 0, "attention_mask")
        frames = num_frames(backbone, value.shape[1])
        if frames is not None and frames < 1:
            raise BatchError(
                f"input_values of {value.shape[1]} samples are too short for {model}'s "
                "feature encoder (it yields no frame); pass longer audio"
            )


def _check_mask(
    attention_mask: Any, batch_seq: tuple[int, ...], past: int, name: str = "attention_mask"
) -> None:
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise BatchError(f"{name} must be a torch.Tensor, got {type(attention_mask).__name__}")
    allowed = [batch_seq] if not past else [(batch_seq[0], past + batch_seq[1])]
    if tuple(attention_mask.shape) not in allowed:
        with_cache = f" (with {past} cached positions: (batch, past + new))" if past else ""
        raise BatchError(
            f"{name} of shape {tuple(attention_mask.shape)} does not match the "
            f"inputs {batch_seq}{with_cache}; expected {allowed[0]}"
        )
    odd = (attention_mask != 0) & (attention_mask != 1)
    if attention_mask.device.type != "meta" and bool(odd.any()):
        raise BatchError(
            f"{name} holds {attention_mask[odd][0].item()!r}; allowed: 0 (padding) or 1 (token)"
        )
