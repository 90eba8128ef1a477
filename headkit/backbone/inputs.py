"""The backbone input stage: every input quirk, once.

``prepare_inputs`` checks a batch's model inputs (headkit errors naming the field, value and
what is allowed), derives position ids from the attention mask for every architecture
(``positions.py``: left padding, gaps, and cached decoding with a ``(batch, past + new)``
mask, as ``generate`` does) and checks them against the backbone's position table before it
runs, casts ``inputs_embeds`` to the backbone's dtype, and speaks the installed
transformers' dialect (the cache's name, output flags through ``**kwargs``).
``HeadedModel.forward`` and feature caching both call it, so they get the same checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from ..errors import BatchError
from .inspection import BackboneInfo, run_backbone
from .positions import (
    check_position_range,
    check_token_type_range,
    mask_position_ids,
    position_scheme,
)

#: Inputs ``HeadedModel.forward`` takes itself; a head's target may not use these names.
MODEL_INPUTS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "past_key_values",
    "inputs_embeds",
    "token_type_ids",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
)
#: What the input stage takes (``MODEL_INPUTS`` but ``return_dict``, which shapes the output).
STAGE_INPUTS = MODEL_INPUTS[:-1]
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


def prepare_inputs(
    backbone: PreTrainedModel,
    info: BackboneInfo,
    batch: Mapping[str, Any],
    check: bool = True,
) -> BackboneInputs:
    """Check a batch's model inputs and build the backbone's keyword arguments (see the
    module docstring). ``batch`` maps ``STAGE_INPUTS`` names to values (None or absent: not
    given); any other key is a BatchError."""
    unknown = sorted(k for k in batch if k not in STAGE_INPUTS)
    if unknown:
        raise BatchError(f"unexpected model input(s) {unknown}; allowed: {list(STAGE_INPUTS)}")
    input_ids, inputs_embeds = batch.get("input_ids"), batch.get("inputs_embeds")
    attention_mask, position_ids = batch.get("attention_mask"), batch.get("position_ids")
    token_type_ids, past_key_values = batch.get("token_type_ids"), batch.get("past_key_values")
    past = _past_length(past_key_values)
    if check:
        check_inputs(
            backbone, input_ids, inputs_embeds, attention_mask, position_ids, token_type_ids, past
        )
    ref = input_ids if input_ids is not None else inputs_embeds
    seq = ref.shape[1]
    inputs_embeds = cast_embeds(backbone, inputs_embeds, check)
    position_ids = resolve_positions(
        backbone, info, attention_mask, position_ids, token_type_ids, ref.shape[:2], past, check
    )
    states_mask = attention_mask
    if attention_mask is not None and attention_mask.shape[1] != seq:
        states_mask = attention_mask[:, -seq:]  # (batch, past + seq): the new positions
    inputs: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "past_key_values": past_key_values,
        "inputs_embeds": inputs_embeds,
        "token_type_ids": token_type_ids,
        "output_attentions": batch.get("output_attentions"),
        "output_hidden_states": batch.get("output_hidden_states"),
    }
    params = info.forward_params
    if "past_key_values" not in params and "cache" in params:  # its name since transformers 5.24.0
        inputs["cache"] = inputs.pop("past_key_values")
    # output_* flags are read from **kwargs by transformers 5 models, not named parameters.
    via_kwargs = {"output_attentions", "output_hidden_states"} if "kwargs" in params else set()
    inputs = {k: v for k, v in inputs.items() if v is not None and (k in params or k in via_kwargs)}
    if "use_cache" in params:
        inputs["use_cache"] = bool(batch.get("use_cache"))
    return BackboneInputs(inputs, states_mask, tuple(ref.shape))


def run_stage(
    backbone: PreTrainedModel,
    info: BackboneInfo,
    inputs: BackboneInputs,
    wanted: set[int],
    early_exit: bool,
) -> tuple[dict[int, torch.Tensor], Any]:
    """``run_backbone`` on prepared inputs; an out-of-range embedding index is a BatchError."""
    try:
        return run_backbone(backbone, info, wanted, early_exit, inputs.kwargs)
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
    emb = _input_embeddings(backbone)
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


# ---------------------------------------------------------------------- checks
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


def _input_embeddings(backbone: PreTrainedModel) -> Any:
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
) -> None:
    """Raise BatchError naming the field, value and what is allowed for malformed inputs."""
    if input_ids is not None and inputs_embeds is not None:
        raise BatchError("pass input_ids or inputs_embeds, not both")
    if input_ids is None and inputs_embeds is None:
        raise BatchError("the batch needs input_ids or inputs_embeds")
    emb = _input_embeddings(backbone)
    if input_ids is not None:
        _int_ids("input_ids", input_ids, None)
        ref = input_ids
    else:
        if not isinstance(inputs_embeds, torch.Tensor) or not inputs_embeds.is_floating_point():
            raise BatchError(
                f"inputs_embeds must be a floating-point torch.Tensor, got "
                f"{getattr(inputs_embeds, 'dtype', type(inputs_embeds).__name__)}"
            )
        ref = inputs_embeds
    want_dim = 2 if input_ids is not None else 3
    if ref.dim() != want_dim or ref.shape[0] == 0 or ref.shape[1] == 0:
        what = "input_ids" if input_ids is not None else "inputs_embeds"
        expected = "2-D (batch >= 1, seq >= 1)" if want_dim == 2 else "3-D (batch, seq, hidden)"
        raise BatchError(
            f"empty or malformed batch: {what} of shape {tuple(ref.shape)}; expected {expected}"
        )
    width = getattr(emb, "embedding_dim", None)
    if inputs_embeds is not None and width is not None and inputs_embeds.shape[-1] != width:
        raise BatchError(
            f"inputs_embeds of width {inputs_embeds.shape[-1]} do not match the backbone's "
            f"embedding width {width}"
        )
    vocab = getattr(emb, "num_embeddings", None)
    if input_ids is not None and vocab is not None and input_ids.device.type != "meta":
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab:
            raise BatchError(
                f"input_ids holds token id {lo if lo < 0 else hi}, outside the vocabulary; "
                f"allowed: 0..{vocab - 1} (the backbone's input embeddings have {vocab} rows)"
            )
    batch_seq = tuple(ref.shape[:2])
    _check_mask(attention_mask, batch_seq, past)
    if token_type_ids is not None:
        _int_ids("token_type_ids", token_type_ids, batch_seq)
    if position_ids is not None:
        _int_ids("position_ids", position_ids, None)
        if position_ids.shape not in (batch_seq, (1, batch_seq[1])):
            raise BatchError(
                f"position_ids of shape {tuple(position_ids.shape)} does not match the inputs; "
                f"expected {batch_seq} or {(1, batch_seq[1])}"
            )


def _check_mask(attention_mask: Any, batch_seq: tuple[int, ...], past: int) -> None:
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise BatchError(
            f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}"
        )
    allowed = [batch_seq] if not past else [(batch_seq[0], past + batch_seq[1])]
    if tuple(attention_mask.shape) not in allowed:
        with_cache = f" (with {past} cached positions: (batch, past + new))" if past else ""
        raise BatchError(
            f"attention_mask of shape {tuple(attention_mask.shape)} does not match the "
            f"inputs {batch_seq}{with_cache}; expected {allowed[0]}"
        )
    odd = (attention_mask != 0) & (attention_mask != 1)
    if attention_mask.device.type != "meta" and bool(odd.any()):
        raise BatchError(
            f"attention_mask holds {attention_mask[odd][0].item()!r}; allowed: 0 (padding) "
            "or 1 (token)"
        )


def cache_of(out: Any) -> Any:
    """The KV cache of a backbone output: ``cache`` (transformers >= 5.24.0; its deprecated
    alias ``past_key_values`` warns) or ``past_key_values`` (transformers < 5.24.0)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)
