"""Images, audio and decoder inputs in a batch: the model inputs that are not padded like
``input_ids``.

``HeadedCollator`` hands every model input of a backbone's forward signature (``pixel_values``,
``input_values``, ``input_features``, ``decoder_input_ids``, ``image_grid_thw``, ...) here:

- audio (``input_values``, one 1-D array of samples per example) is padded on the right with
  0 to the longest example, with an ``attention_mask`` of 1 for real samples (right padding
  is what speech models' frame masks assume);
- decoder token ids are padded on the right with the pad id, with a
  ``decoder_attention_mask``;
- a per-token input of an example's ``input_ids`` length (Qwen2-VL's ``mm_token_type_ids``)
  is padded as the token inputs are, with 0;
- a mask that comes with spectrograms (Whisper's ``input_features``) is stacked;
- images and anything else are stacked, one item per example (``pixel_values`` of shape
  (channels, height, width)), or concatenated when examples hold several items each (a
  processor's (images, channels, height, width), Qwen2-VL's flattened patches and
  ``image_grid_thw`` rows);
- anything that is not a number (a flag such as ``interpolate_pos_encoding``) must be the same
  in every example and is passed once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import BatchError

#: The rank of one item of a per-image input: an example holding a value of this rank holds
#: one item (stacked); a value of another rank holds several (concatenated).
ONE_ITEM_RANK = {
    "pixel_values": 3,
    "pixel_values_videos": 4,
    "pixel_attention_mask": 2,
    "image_sizes": 1,
    "image_grid_thw": 1,
    "video_grid_thw": 1,
    "input_features": 2,
}
#: Inputs that are audio samples, padded with a sample-level attention mask.
AUDIO_INPUTS = ("input_values",)
#: Decoder token ids and the mask built for them.
DECODER_IDS = {"decoder_input_ids": "decoder_attention_mask"}
#: The model inputs a collator without a model treats as such (a model lists its own).
DEFAULT_SIGNALS = (
    *ONE_ITEM_RANK,
    *AUDIO_INPUTS,
    *DECODER_IDS,
    *DECODER_IDS.values(),
    "mm_token_type_ids",
)


def signal_keys(model: Any) -> tuple[str, ...]:
    """The inputs of ``model``'s backbone beyond the token inputs (``info.extra_inputs``), or
    ``DEFAULT_SIGNALS`` without a model."""
    info = getattr(model, "info", None)
    return tuple(info.extra_inputs) if info is not None else DEFAULT_SIGNALS


def collate_signals(
    features: Sequence[Mapping[str, Any]],
    keys: Sequence[str],
    pad_token_id: int,
    lengths: Sequence[int] | None,
    pad: Any,
) -> dict[str, Any]:
    """The batch entries of ``keys`` (see the module docstring); ``lengths`` are the
    examples' ``input_ids`` lengths (None without token inputs) and ``pad(rows, value)``
    pads per-token rows as the token inputs are padded."""
    out: dict[str, Any] = {}
    for key in keys:
        values = [f.get(key) for f in features]
        if all(v is None for v in values) or key in DECODER_IDS.values():
            continue
        missing = [i for i, v in enumerate(values) if v is None]
        if missing:
            raise BatchError(
                f"HeadedCollator: feature {missing[0]} has no {key!r}, but feature "
                f"{values.index(next(v for v in values if v is not None))} has; every example "
                f"needs it"
            )
        if not _numeric(values[0]):
            out[key] = _same_value(key, values)
            continue
        tensors = [_tensor(v, key, i) for i, v in enumerate(values)]
        if key in AUDIO_INPUTS:
            out[key], out["attention_mask"] = _pad_right(tensors, 0.0, key)
        elif key in DECODER_IDS:
            ids, mask = _pad_right([t.long() for t in tensors], pad_token_id, key)
            given = [f.get(DECODER_IDS[key]) for f in features]
            if all(g is not None for g in given):
                mask, _ = _pad_right(
                    [_tensor(g, DECODER_IDS[key], i) for i, g in enumerate(given)], 0, key
                )
            out[key], out[DECODER_IDS[key]] = ids, mask.long()
        elif (
            lengths is not None
            and all(t.dim() == 1 and t.shape[0] == n for t, n in zip(tensors, lengths))
            and key not in ONE_ITEM_RANK
        ):
            out[key] = pad(tensors, 0)
        else:
            out[key] = _stack_or_concatenate(key, tensors)
    masks = [f.get("attention_mask") for f in features]
    if lengths is None and out and "attention_mask" not in out and None not in masks:
        # a spectrogram's frame mask (Whisper's feature extractor): one row per example
        rows = [_tensor(m, "attention_mask", i) for i, m in enumerate(masks)]
        out["attention_mask"] = _stack_or_concatenate("attention_mask", rows).long()
    return out


def _numeric(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return True
    if isinstance(value, (bool, str, bytes)) or value is None:
        return False
    return isinstance(value, (int, float, Sequence))


def _same_value(key: str, values: list[Any]) -> Any:
    if any(v != values[0] for v in values):
        raise BatchError(
            f"HeadedCollator: {key!r} differs between examples ({values[0]!r} and "
            f"{next(v for v in values if v != values[0])!r}); it applies to the whole batch"
        )
    return values[0]


def _tensor(value: Any, key: str, index: int) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise BatchError(
            f"HeadedCollator: feature {index} has {key} that is no array ({e})"
        ) from None
    if arr.dtype.kind not in "biuf":
        raise BatchError(
            f"HeadedCollator: feature {index} has {key} of {arr.dtype} values; expected numbers "
            "(run the model's processor on images and audio first)"
        )
    tensor = torch.from_numpy(arr.copy())
    return tensor.float() if tensor.dtype == torch.float64 else tensor


def _pad_right(
    rows: list[torch.Tensor], value: float, key: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, longest) padded on the right with ``value``, and the mask of real entries."""
    bad = [i for i, r in enumerate(rows) if r.dim() != 1 or r.shape[0] == 0]
    if bad:
        raise BatchError(
            f"HeadedCollator: feature {bad[0]} has {key} of shape {tuple(rows[bad[0]].shape)}; "
            "expected one non-empty 1-D sequence per example"
        )
    width = max(r.shape[0] for r in rows)
    out = torch.full((len(rows), width), value, dtype=rows[0].dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
        mask[i, : r.shape[0]] = 1
    return out, mask


def _stack_or_concatenate(key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    rank = ONE_ITEM_RANK.get(key)
    several = rank is not None and tensors[0].dim() != rank
    shapes = {tuple(t.shape[1:] if several else t.shape) for t in tensors}
    if len(shapes) > 1:
        raise BatchError(
            f"HeadedCollator: {key} of different shapes {sorted(shapes)} cannot be batched; "
            "resize the images (the model's processor does) or pad the inputs first"
        )
    return torch.cat(tensors) if several else torch.stack(tensors)
