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
from .modalities import image_token_ids, num_frames


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


def check_finite(name: str, value: torch.Tensor) -> None:
    """BatchError naming ``name`` and the first row (index along dim 0) that holds NaN or an
    infinity: a non-finite input gives NaN predictions, never an error, further on."""
    if value.device.type == "meta" or not value.is_floating_point():
        return
    if bool(torch.isfinite(value.sum())):  # NaN and infinities reach the sum: one cheap pass
        return
    finite = torch.isfinite(value)
    if bool(finite.all()):  # finite values whose sum overflowed
        return
    row = int((~finite).reshape(value.shape[0], -1).any(-1).nonzero()[0, 0])
    bad = value[row][~finite[row]][0].item()
    raise BatchError(
        f"{name} row {row} holds {bad}; allowed: finite values (check the processor's output "
        "and the data it read)"
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
    if inputs_embeds is not None:
        check_finite(embeds_name, inputs_embeds)
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
    check_finite(name, value)
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
    patch = getattr(config, "patch_size", None) if name == "pixel_values" else None
    patch_hw = (patch, patch) if isinstance(patch, int) else patch
    if isinstance(patch_hw, (list, tuple)) and any(
        n < p for n, p in zip(value.shape[2:], patch_hw)
    ):
        raise BatchError(
            f"pixel_values of {tuple(value.shape[2:])} pixels are smaller than one patch of "
            f"{model} (patch_size={patch}); allowed: images of at least "
            f"{patch_hw[0]}x{patch_hw[1]} pixels"
        )
    if name == "input_values":
        _check_mask(attention_mask, tuple(value.shape), 0, "attention_mask")
        _check_audio_length(backbone, value, attention_mask)


def min_samples(backbone: PreTrainedModel) -> int | None:
    """The fewest samples of audio a speech model's feature encoder makes one frame of (its
    receptive field; None for a model without ``_get_feat_extract_output_lengths``)."""
    if num_frames(backbone, 1) is None:
        return None
    if num_frames(backbone, 1) >= 1:
        return 1
    hi = 2
    while num_frames(backbone, hi) < 1:  # the frames grow with the samples: double, then halve
        hi *= 2
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if num_frames(backbone, mid) >= 1 else (mid, hi)
    return hi


def _check_audio_length(backbone: PreTrainedModel, value: torch.Tensor, mask: Any) -> None:
    """Every clip (its real samples, by ``mask``) yields at least one frame."""
    lengths = [value.shape[1]]
    if isinstance(mask, torch.Tensor) and mask.device.type != "meta":
        lengths = mask.long().sum(-1).tolist()
    frames = num_frames(backbone, min(lengths))
    if frames is None or frames >= 1:  # the shortest clip makes a frame: all do
        return
    least = min_samples(backbone)
    short = [i for i, n in enumerate(lengths) if least is not None and n < least]
    if short:
        row = short[0] if len(lengths) > 1 else 0
        raise BatchError(
            f"input_values row {row} has {lengths[row]} samples of audio, fewer than the "
            f"{least} that {type(backbone).__name__}'s feature encoder needs for one frame "
            f"(its receptive field); allowed: clips of at least {least} samples"
        )


def check_vision_language(backbone: PreTrainedModel, batch: Mapping[str, Any]) -> None:
    """Raise BatchError where a vision-language batch's image tokens and images disagree:
    image tokens without ``pixel_values`` (or images without image tokens), pixels that are
    not floating point or not finite, ``image_grid_thw`` (Qwen2-VL) whose patches are not the
    pixels' rows or the image tokens, ``image_sizes`` larger than the pixels or not one per
    image, and a Llava-style batch whose image tokens are not the images' patches."""
    ids, pixels = batch.get("input_ids"), batch.get("pixel_values")
    videos = batch.get("pixel_values_videos")
    tokens = image_token_ids(backbone.config)
    for name, value in (("pixel_values", pixels), ("pixel_values_videos", videos)):
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise BatchError(
                f"{name} must be a floating-point torch.Tensor, got "
                f"{getattr(value, 'dtype', type(value).__name__)}; use the model's processor "
                "with return_tensors='pt'"
            )
        check_finite(name, value)
    if not isinstance(ids, torch.Tensor) or not tokens or ids.device.type == "meta":
        return
    config, model = backbone.config, type(backbone).__name__
    image_id = tokens[0]
    count = int((ids == image_id).sum())
    if count and pixels is None:
        raise BatchError(
            f"input_ids hold {count} image tokens (id {image_id}) but the batch has no "
            f"pixel_values; pass the images the prompt refers to (the model's processor "
            "returns both)"
        )
    if pixels is None:
        return
    if not count:
        raise BatchError(
            f"the batch has pixel_values of shape {tuple(pixels.shape)} but input_ids hold no "
            f"image token (id {image_id}); put the processor's image tokens in the text"
        )
    grid = batch.get("image_grid_thw")
    if isinstance(grid, torch.Tensor):
        _check_grid(config, model, grid, pixels, count)
        return
    if pixels.dim() == 5:  # several images per example (Idefics3): all-zero ones are padding
        images = int((pixels.flatten(2) != 0).any(-1).sum())
        per_image = _merged_tokens_per_image(config, pixels)
        _check_image_token_count(count, image_id, images, per_image)
        return
    if pixels.dim() != 4:
        return
    images = pixels.shape[0]
    sizes = batch.get("image_sizes")
    if isinstance(sizes, torch.Tensor):
        height, width = pixels.shape[-2:]
        if (
            sizes.shape != (images, 2)
            or bool((sizes < 1).any())
            or bool((sizes[:, 0] > height).any() | (sizes[:, 1] > width).any())
        ):
            raise BatchError(
                f"image_sizes of shape {tuple(sizes.shape)} ({sizes.tolist()[:4]}) do not fit "
                f"pixel_values of shape {tuple(pixels.shape)}; allowed: one (height, width) "
                f"per image, each within 1..{height} x 1..{width}"
            )
    if sizes is None:  # images of their own sizes (Pixtral) are split in patches of their own
        _check_image_token_count(count, image_id, images, _tokens_per_image(config, pixels))


def _check_image_token_count(count: int, image_id: int, images: int, per_image: Any) -> None:
    if per_image is not None and count != images * per_image:
        raise BatchError(
            f"input_ids hold {count} image tokens (id {image_id}) but pixel_values hold "
            f"{images} image(s) of {per_image} patches each ({images * per_image} tokens); "
            "allowed: as many image tokens as patches (the model's processor expands each "
            "image's token)"
        )


def _merged_tokens_per_image(config: Any, pixels: torch.Tensor) -> int | None:
    """Image tokens an Idefics3-style model puts in for one image: its patches merged
    ``scale_factor``² to a token (the pixel shuffle)."""
    patch = getattr(getattr(config, "vision_config", None), "patch_size", None)
    scale = getattr(config, "scale_factor", None)
    if not isinstance(patch, int) or not isinstance(scale, int) or scale < 1:
        return None
    return (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch) // scale**2


def _tokens_per_image(config: Any, pixels: torch.Tensor) -> int | None:
    """Image tokens a Llava-style model puts in for one image of ``pixels``' size: its vision
    tower's patches (+ the CLS token with ``vision_feature_select_strategy="full"``), for
    images of the tower's ``image_size`` (None where that is not known)."""
    vision = getattr(config, "vision_config", None)
    patch = getattr(vision, "patch_size", None)
    size = getattr(vision, "image_size", None)
    strategy = getattr(config, "vision_feature_select_strategy", None)
    if not isinstance(patch, int) or strategy not in ("default", "full"):
        return None
    if tuple(pixels.shape[-2:]) != (size, size):  # only the vision tower's own image size
        return None
    patches = (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch)
    return patches + (strategy == "full")


def _check_grid(
    config: Any, model: str, grid: torch.Tensor, pixels: torch.Tensor, count: int
) -> None:
    """Qwen2-VL: one (t, h, w) row per image, whose patches are ``pixels``' rows, merged
    ``spatial_merge_size``² to a token."""
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", 1) or 1
    if grid.dim() != 2 or grid.shape[1] != 3 or bool((grid < 1).any()):
        raise BatchError(
            f"image_grid_thw of shape {tuple(grid.shape)}; expected one (t, h, w) row of "
            "positive patch counts per image"
        )
    patches = int(grid.prod(-1).sum())
    if pixels.dim() != 2 or pixels.shape[0] != patches:
        raise BatchError(
            f"image_grid_thw ({grid.tolist()[:4]}) describes {patches} patches, but "
            f"pixel_values of shape {tuple(pixels.shape)} hold "
            f"{pixels.shape[0] if pixels.dim() == 2 else 'no flat rows of'} patches; "
            "allowed: the rows the model's processor returned with it"
        )
    if count != patches // merge**2:
        raise BatchError(
            f"input_ids hold {count} image tokens, but image_grid_thw describes "
            f"{patches // merge**2} ({patches} patches merged {merge}x{merge} in {model}); "
            "allowed: as many image tokens as merged patches"
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
