"""The backbone input stage: every input quirk, once.

``prepare_inputs`` checks a batch's model inputs (headkit errors naming the field, value and
what is allowed), derives position ids from the attention mask for every architecture
(``positions.py``: left padding, gaps, and cached decoding with a ``(batch, past + new)``
mask, as ``generate`` does) and checks them against the backbone's position table before it
runs, casts ``inputs_embeds`` to the backbone's dtype, and speaks the installed
transformers' dialect (the cache's name, output flags through ``**kwargs``).
``HeadedModel.forward`` and feature caching both call it, so they get the same checks.

Inputs of every modality come through here: the names a backbone accepts beyond the stage's
own are those of its forward signature (``pixel_values``, ``input_values``,
``input_features``, ``decoder_input_ids``, ``image_grid_thw``, ...; ``accepted_inputs``);
any other key is a BatchError naming the allowed ones. The mask over the positions heads
read is the attention mask for tokens, the model's own frame mask for speech, none for
images, and per stack for encoder–decoder models (``modalities.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from ..errors import BatchError
from .checks import check_inputs, check_signal, check_vision_language, input_embeddings
from .inspection import OWN_INPUTS, BackboneInfo, StateKey, run_backbone
from .modalities import SIGNAL_INPUTS, frame_mask
from .positions import (
    check_position_range,
    check_token_type_range,
    mask_position_ids,
    position_scheme,
)

#: Inputs ``HeadedModel.forward`` takes itself; a head's target may not use these names.
MODEL_INPUTS = (*OWN_INPUTS, "return_dict")
#: What the input stage takes of every backbone (``MODEL_INPUTS`` but ``return_dict``, which
#: shapes the output); ``accepted_inputs`` adds those of the backbone's forward signature.
STAGE_INPUTS = OWN_INPUTS
#: An encoder–decoder model's decoder inputs → the names its decoder's forward takes them by.
DECODER_INPUTS = {
    "decoder_input_ids": "input_ids",
    "decoder_attention_mask": "attention_mask",
    "decoder_inputs_embeds": "inputs_embeds",
    "decoder_position_ids": "position_ids",
}
#: Per-token inputs a collator pads, with their pad value (None: the pad token id).
TOKEN_INPUT_PADS: dict[str, int | None] = {
    "input_ids": None,
    "attention_mask": 0,
    "token_type_ids": 0,
    "position_ids": 0,
}
#: The model inputs a batch of examples carries (the others are call options).
BATCH_INPUTS = (*TOKEN_INPUT_PADS, "inputs_embeds")
#: Keys tokenizers add that are no model input: sentence-transformers 6's ``preprocess`` /
#: ``tokenize`` adds ``modality`` (a string) and, with prompts, ``prompt_length``.
TOKENIZER_EXTRAS = ("modality", "prompt_length")


def accepted_inputs(info: BackboneInfo) -> tuple[str, ...]:
    """Every input name the stage takes for this backbone: its own, then the backbone's."""
    return (*STAGE_INPUTS, *info.extra_inputs)


def batch_inputs(info: BackboneInfo) -> tuple[str, ...]:
    """The model inputs a batch of examples may carry for this backbone (``BATCH_INPUTS`` and
    the inputs of its forward signature: ``pixel_values``, ``input_values``, ...)."""
    return (*BATCH_INPUTS, *info.extra_inputs)


def split_inputs(info: BackboneInfo, kwargs: Mapping[str, Any]) -> tuple[dict, dict]:
    """(the backbone's own inputs among ``kwargs``, the rest): ``HeadedModel.forward`` gets
    ``pixel_values`` and the like through ``**kwargs``, beside the heads' labels."""
    own = {k: v for k, v in kwargs.items() if k in info.extra_inputs}
    return own, {k: v for k, v in kwargs.items() if k not in own}


def drop_tokenizer_extras(batch: dict[str, Any], targets: set[str]) -> dict[str, Any]:
    """``batch`` without the ``TOKENIZER_EXTRAS`` keys (a head target of that name is kept),
    so that ``model(**st.tokenize(texts))`` works."""
    extras = [k for k in TOKENIZER_EXTRAS if k in batch and k not in targets]
    return {k: v for k, v in batch.items() if k not in extras} if extras else batch


@dataclass
class BackboneInputs:
    """What the backbone is called with, and the mask over the positions it computes.

    ``mask`` is (batch, seq) for the new positions only (None: every token counts), also
    when the caller passed a ``(batch, past + seq)`` mask for cached decoding.
    """

    kwargs: dict[str, Any]
    mask: torch.Tensor | None
    shape: tuple[int, ...]
    input_ids: torch.Tensor | None = None  # which positions are image tokens (pool_over)
    decoder_kwargs: dict[str, Any] | None = None  # an encoder–decoder model's decoder inputs
    decoder_mask: torch.Tensor | None = None  # over the decoder's new positions


def prepare_inputs(
    backbone: PreTrainedModel,
    info: BackboneInfo,
    batch: Mapping[str, Any],
    check: bool = True,
) -> BackboneInputs:
    """Check a batch's model inputs and build the backbone's keyword arguments (see the
    module docstring). ``batch`` maps ``accepted_inputs(info)`` names to values (None or
    absent: not given); any other key is a BatchError."""
    allowed = accepted_inputs(info)
    unknown = sorted(k for k in batch if k not in allowed)
    if unknown:
        raise BatchError(f"unexpected model input(s) {unknown}; allowed: {list(allowed)}")
    extras = {
        k: _cast_signal(backbone, k, batch[k])
        for k in info.extra_inputs
        if batch.get(k) is not None and k not in DECODER_INPUTS
    }
    if info.main_input in SIGNAL_INPUTS:
        inputs = _signal_inputs(backbone, info, batch, extras, check)
    else:
        inputs = _token_inputs(backbone, info, batch, extras, check)
        if check and info.modality == "vision-language":
            check_vision_language(backbone, batch)
    if info.decoder is not None:
        inputs.decoder_kwargs, inputs.decoder_mask = prepare_decoder_inputs(
            backbone, info, batch, check
        )
        if check and inputs.decoder_kwargs is not None:
            _check_stack_batches(info, inputs.shape[0], batch)
    return inputs


def _check_stack_batches(info: BackboneInfo, rows: int, batch: Mapping[str, Any]) -> None:
    """An encoder–decoder batch's encoder and decoder inputs have as many rows."""
    decoder = next(
        batch[k] for k in ("decoder_input_ids", "decoder_inputs_embeds") if batch.get(k) is not None
    )
    if decoder.shape[0] != rows:
        name = (
            "decoder_input_ids"
            if batch.get("decoder_input_ids") is not None
            else "decoder_inputs_embeds"
        )
        raise BatchError(
            f"{name} has {decoder.shape[0]} rows but the encoder's {info.main_input} has "
            f"{rows}; allowed: one decoder row per encoder row"
        )


def _token_inputs(
    backbone: PreTrainedModel,
    info: BackboneInfo,
    batch: Mapping[str, Any],
    extras: dict[str, Any],
    check: bool,
) -> BackboneInputs:
    """The stage for a backbone driven by token ids (text, vision-language, T5/BART)."""
    input_ids, inputs_embeds = batch.get("input_ids"), batch.get("inputs_embeds")
    attention_mask, position_ids = batch.get("attention_mask"), batch.get("position_ids")
    token_type_ids, past_key_values = batch.get("token_type_ids"), batch.get("past_key_values")
    past = _past_length(past_key_values)
    params = info.stack_params or info.forward_params
    if token_type_ids is not None and "token_type_ids" not in params:
        # a tokenizer made for another model: they would be dropped, and the model not told
        raise BatchError(
            f"token_type_ids were given, but {type(backbone).__name__} takes none (it has no "
            "token-type table); remove them from the batch (return_token_type_ids=False)"
        )
    if check:
        check_inputs(
            backbone, input_ids, inputs_embeds, attention_mask, position_ids, token_type_ids, past
        )
    ref = input_ids if input_ids is not None else inputs_embeds
    seq = ref.shape[1]
    inputs_embeds = cast_embeds(backbone, inputs_embeds, check)
    if not info.own_positions and info.decoder is None:
        position_ids = resolve_positions(
            backbone, info, attention_mask, position_ids, token_type_ids, ref.shape[:2], past, check
        )
    states_mask = attention_mask
    if attention_mask is not None and attention_mask.shape[1] != seq:
        states_mask = attention_mask[:, -seq:]  # (batch, past + seq): the new positions
    encoder_decoder = info.decoder is not None  # the cache and its flag go to the decoder
    inputs: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "past_key_values": None if encoder_decoder else past_key_values,
        "inputs_embeds": inputs_embeds,
        "token_type_ids": token_type_ids,
        **extras,
    }
    kwargs = _call_kwargs(info, inputs, batch, use_cache=not encoder_decoder)
    return BackboneInputs(kwargs, states_mask, tuple(ref.shape), input_ids=input_ids)


def _signal_inputs(
    backbone: PreTrainedModel,
    info: BackboneInfo,
    batch: Mapping[str, Any],
    extras: dict[str, Any],
    check: bool,
) -> BackboneInputs:
    """The stage for a backbone driven by images or audio (``pixel_values``,
    ``input_values``, ``input_features``): no token inputs, no positions; speech states are
    counted at the frames of real audio."""
    name = info.main_input
    value, attention_mask = batch.get(name), batch.get("attention_mask")
    if check:
        check_signal(backbone, info, batch, value, attention_mask)
    states_mask = None
    if info.modality == "speech":
        states_mask = frame_mask(backbone, attention_mask, value.shape[-1])
    inputs = {"attention_mask": attention_mask, **extras}
    kwargs = _call_kwargs(info, inputs, batch, use_cache=False)
    return BackboneInputs(kwargs, states_mask, tuple(value.shape))


def _call_kwargs(
    info: BackboneInfo, inputs: dict[str, Any], batch: Mapping[str, Any], use_cache: bool
) -> dict[str, Any]:
    """The keyword arguments the module running the (first) stack takes, in the installed
    transformers' dialect: the cache's name, output flags through ``**kwargs``."""
    inputs = {
        **inputs,
        "output_attentions": batch.get("output_attentions"),
        "output_hidden_states": batch.get("output_hidden_states"),
    }
    params = info.stack_params or info.forward_params
    if "past_key_values" not in params and "cache" in params:  # its name since transformers 5.24.0
        inputs["cache"] = inputs.pop("past_key_values", None)
    # output_* flags are read from **kwargs by transformers 5 models, not named parameters.
    via_kwargs = {"output_attentions", "output_hidden_states"} if "kwargs" in params else set()
    inputs = {k: v for k, v in inputs.items() if v is not None and (k in params or k in via_kwargs)}
    if "use_cache" in params:
        inputs["use_cache"] = bool(batch.get("use_cache")) and use_cache
    return inputs


def prepare_decoder_inputs(
    backbone: PreTrainedModel, info: BackboneInfo, batch: Mapping[str, Any], check: bool
) -> tuple[dict[str, Any] | None, torch.Tensor | None]:
    """An encoder–decoder model's decoder kwargs (its own names) and the mask over its new
    positions; (None, None) when the batch has no decoder inputs."""
    given = {DECODER_INPUTS[k]: batch.get(k) for k in DECODER_INPUTS if batch.get(k) is not None}
    cache = batch.get("past_key_values")
    if "input_ids" not in given and "inputs_embeds" not in given:
        return None, None
    decoder = backbone.get_decoder()
    past = _past_length(cache)
    ids, embeds = given.get("input_ids"), given.get("inputs_embeds")
    mask = given.get("attention_mask")
    if check:
        check_inputs(decoder, ids, embeds, mask, given.get("position_ids"), None, past, "decoder_")
    given["inputs_embeds"] = cast_embeds(decoder, embeds, check)
    seq = (ids if ids is not None else embeds).shape[1]
    states_mask = mask[:, -seq:] if mask is not None else None
    flags = {k: batch.get(k) for k in ("use_cache", "output_attentions", "output_hidden_states")}
    kwargs = _call_kwargs(info.decoder, {**given, "past_key_values": cache}, flags, True)
    return kwargs, states_mask


def _cast_signal(backbone: PreTrainedModel, name: str, value: Any) -> Any:
    """Images and audio in the backbone's floating dtype (float32 arrays into a bfloat16
    model); other inputs as they are."""
    if name not in SIGNAL_INPUTS and not name.startswith("pixel_values"):
        return value
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return value
    dtype = getattr(backbone, "dtype", value.dtype)
    return value.to(dtype) if dtype.is_floating_point and dtype != value.dtype else value


def run_stage(
    backbone: PreTrainedModel,
    info: BackboneInfo,
    inputs: BackboneInputs,
    wanted: set[StateKey],
    early_exit: bool,
) -> tuple[dict[StateKey, torch.Tensor], Any]:
    """``run_backbone`` on prepared inputs; an out-of-range embedding index is a BatchError,
    and so are heads on an encoder–decoder model's decoder without decoder inputs."""
    if inputs.decoder_kwargs is None and any(k.on_decoder for k in wanted):
        raise BatchError(
            f"heads on the decoder of {type(backbone).__name__} (stack='decoder') need "
            "decoder_input_ids (or decoder_inputs_embeds) in the batch; heads with "
            "stack='encoder' run the encoder alone"
        )
    try:
        return run_backbone(
            backbone, info, wanted, early_exit, inputs.kwargs, inputs.decoder_kwargs
        )
    except IndexError as e:  # an embedding lookup (positions, token types) out of range
        limits = {
            "max_position_embeddings": config_value(
                backbone, "max_position_embeddings", "n_positions"
            ),
            "type_vocab_size": config_value(backbone, "type_vocab_size"),
        }
        allowed = ", ".join(f"{k}={v}" for k, v in limits.items() if v is not None)
        raise BatchError(
            f"the backbone rejected an index in the batch ({e}); input shape {inputs.shape}: "
            f"sequence length, position_ids and token_type_ids must stay within "
            f"{allowed or 'the backbone config'}"
        ) from e


def resolve_positions(
    backbone: PreTrainedModel,
    info: BackboneInfo,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    token_type_ids: torch.Tensor | None,
    shape: tuple[int, ...],
    past: int,
    check: bool = True,
) -> torch.Tensor | None:
    """The position ids to pass (the caller's, else from the mask: ``positions.py``), checked
    with the token type ids against the backbone's tables before the backbone runs."""
    scheme = info.positions or position_scheme(backbone, info.forward_params)
    seq = shape[1]
    derived = mask_position_ids(
        backbone, scheme, info.is_decoder, attention_mask, position_ids, seq, check
    )
    if check:
        check_position_range(scheme, derived, position_ids is not None, seq, past, tuple(shape))
        check_token_type_range(backbone, token_type_ids)
    return derived


def cast_embeds(backbone: PreTrainedModel, inputs_embeds: Any, check: bool = True) -> Any:
    """``inputs_embeds`` in the dtype of the backbone's embeddings (float64 → float32, ...);
    a BatchError when a finite value does not fit that dtype."""
    emb = input_embeddings(backbone)
    weight = getattr(emb, "weight", None)
    if inputs_embeds is None or not isinstance(weight, torch.Tensor):
        return inputs_embeds
    if inputs_embeds.dtype == weight.dtype:
        return inputs_embeds
    cast = inputs_embeds.to(weight.dtype)
    if check and inputs_embeds.device.type != "meta":
        lost = torch.isfinite(inputs_embeds) & ~torch.isfinite(cast)
        if bool(lost.any()):
            raise BatchError(
                f"inputs_embeds of dtype {inputs_embeds.dtype} hold "
                f"{inputs_embeds[lost][0].item():g}, which overflows the backbone's dtype "
                f"{weight.dtype}; allowed: values within +-{torch.finfo(weight.dtype).max:g}"
            )
    return cast


def config_value(backbone: PreTrainedModel, *names: str) -> Any:
    """The first of ``names`` the backbone's config sets (None if none)."""
    for n in names:
        if getattr(backbone.config, n, None) is not None:
            return getattr(backbone.config, n)
    return None


def _past_length(cache: Any) -> int:
    """Tokens already in a KV cache (0 without one)."""
    if cache is None:
        return 0
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    try:  # legacy tuple of (key, value) per layer: key (batch, heads, past, head_dim)
        return int(cache[0][0].shape[-2])
    except (TypeError, IndexError, AttributeError):
        return 0
