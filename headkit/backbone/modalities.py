"""What differs between model families, in one place: inputs, masks, stacks and output rules.

Everything here is read from the model itself (its ``main_input_name``, its forward signature,
its config, the methods it defines), never from a per-architecture map:

- text encoders (BERT, ...): ``input_ids`` (+ ``attention_mask``, ``token_type_ids``);
  positions that count: the attention mask; default pooling "first" ([CLS]).
- text decoders (GPT-2, Llama, ...): ``input_ids``; the attention mask; "last".
- vision (ViT, DINOv2, CLIP/SigLIP vision): ``pixel_values``; every patch (no padding);
  "first" (the CLS token) where the model has one, else "mean".
- speech (wav2vec2, HuBERT, WavLM, Whisper's encoder): ``input_values`` /
  ``input_features`` (+ a sample-level ``attention_mask``); the frames of real audio, by
  the model's own reduction of the mask (``frame_mask``); "mean".
- encoder–decoder (T5, BART, Whisper): the encoder's input (+ ``decoder_input_ids``,
  ``decoder_attention_mask``); per stack, its own mask; "first" on the encoder, "last" on
  the decoder.
- vision-language (Llava, Qwen2-VL, Idefics3): ``input_ids`` with image tokens (+
  ``pixel_values``, ``image_sizes``, ``image_grid_thw``, ``pixel_attention_mask``); the
  attention mask, image tokens counting like text unless ``pool_over`` narrows it; "last".
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .._transformers import (
    auto_model_types,
    can_record_outputs,
    feat_extract_output_lengths,
    feature_vector_attention_mask,
)
from ..config import STACKS
from ..heads.pooling import pools_every_position

#: Main inputs that are signals rather than token ids, and the modality each drives.
SIGNAL_INPUTS = {"pixel_values": "vision", "input_values": "speech", "input_features": "speech"}
#: Forward parameters that are call options or outputs, never inputs of a batch.
NOT_INPUTS = frozenset(
    {
        "self",
        "args",
        "kwargs",
        "labels",
        "return_dict",
        "return_loss",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "encoder_outputs",
        "cache",
        "logits_to_keep",
    }
)
#: Modalities a backbone can have (``modality_of``).
MODALITIES = ("text", "vision", "speech", "vision-language")
#: The stack name of an encoder–decoder model's decoder (``StateKey.stack``, ``HeadConfig.stack``).
DECODER = STACKS[1]
#: Config attributes holding the ids of the tokens that stand for image (or video) patches.
_IMAGE_TOKEN_ATTRS = ("image_token_id", "image_token_index", "video_token_id")


def modality_of(backbone: nn.Module, params: Iterable[str]) -> str:
    """ "text", "vision", "speech" or "vision-language", from ``main_input_name`` and the
    forward signature (a text model that also takes ``pixel_values`` is vision-language)."""
    main = main_input_of(backbone)
    if main in SIGNAL_INPUTS:
        return SIGNAL_INPUTS[main]
    return "vision-language" if "pixel_values" in set(params) else "text"


def main_input_of(backbone: nn.Module) -> str:
    """The input the backbone is driven by (``PreTrainedModel.main_input_name``)."""
    name = getattr(backbone, "main_input_name", None)
    return name if isinstance(name, str) and name else "input_ids"


def extra_inputs(params: Iterable[str], own: Iterable[str]) -> tuple[str, ...]:
    """The forward parameters that are batch inputs beyond ``own`` (the input stage's own
    names): ``pixel_values``, ``input_values``, ``decoder_input_ids``, ``image_grid_thw``, ..."""
    taken = set(own) | NOT_INPUTS
    return tuple(p for p in params if p not in taken)


def forward_params(module: nn.Module) -> list[str]:
    """The names of ``module.forward``'s parameters, in order."""
    return list(inspect.signature(module.forward).parameters)


def image_token_ids(config: Any) -> tuple[int, ...]:
    """The ids of the tokens that hold image (or video) patches in a vision-language model's
    ``input_ids`` (empty for other models)."""
    ids = []
    for attr in _IMAGE_TOKEN_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value not in ids:
            ids.append(value)
    return tuple(ids)


def pool_over_mask(
    mask: torch.Tensor | None, input_ids: torch.Tensor | None, ids: tuple[int, ...], which: str
) -> torch.Tensor | None:
    """``mask`` restricted to text positions (``which="text"``) or image positions ("image");
    ``which="all"`` returns it unchanged. (batch, seq) bool."""
    if which == "all":
        return mask
    is_image = torch.zeros_like(input_ids, dtype=torch.bool)
    for token in ids:  # comparisons with Python ints: no tensor of ids copied to the device
        is_image |= input_ids == token
    keep = is_image if which == "image" else ~is_image
    return keep if mask is None else keep & mask.bool()


def frame_mask(
    backbone: nn.Module, attention_mask: torch.Tensor | None, num_samples: int
) -> torch.Tensor | None:
    """A speech model's sample-level mask reduced to its frames, as the model reduces it
    (``_get_feature_vector_attention_mask``; models without it, such as Whisper's encoder,
    by ``_get_feat_extract_output_lengths`` of the real samples). None stays None."""
    if attention_mask is None:
        return None
    frames = num_frames(backbone, num_samples)
    if frames is None:
        return attention_mask
    lengths_of = feat_extract_output_lengths(backbone)
    reduce = feature_vector_attention_mask(backbone)
    if reduce is not None:
        return reduce(frames, attention_mask)
    real = lengths_of(attention_mask.long().sum(-1))  # (batch,)
    return torch.arange(frames, device=attention_mask.device) < real.unsqueeze(-1)


def frame_lengths(
    backbone: nn.Module, sample_lengths: torch.Tensor, num_samples: int
) -> tuple[list[int], int] | None:
    """(each example's frames, the frames of the padded batch) of a speech model whose
    audio of ``sample_lengths`` real samples is padded to ``num_samples``: the counts its
    own frame mask and hidden states have (``_get_feat_extract_output_lengths``). None for a
    model without one."""
    frames = num_frames(backbone, num_samples)
    if frames is None:
        return None
    real = feat_extract_output_lengths(backbone)(sample_lengths.long())
    return [int(n) for n in real], frames


def num_frames(backbone: nn.Module, num_samples: int) -> int | None:
    """The frames a speech model makes of ``num_samples`` samples of audio (its
    ``_get_feat_extract_output_lengths``; None for a model without one)."""
    lengths_of = feat_extract_output_lengths(backbone)
    return None if lengths_of is None else int(lengths_of(torch.tensor(num_samples)))


def recorded_block_classes(module: nn.Module) -> tuple[type, ...]:
    """The block classes whose outputs the model itself records as ``hidden_states`` (its
    ``_can_record_outputs``): the block stack is a list of those (not, say, wav2vec2's list
    of convolutions of the same length)."""
    spec = can_record_outputs(type(module)).get("hidden_states")
    specs = spec if isinstance(spec, (list, tuple)) else [spec]
    classes = [getattr(s, "target_class", s) for s in specs]
    return tuple(c for c in classes if isinstance(c, type))


def computes_own_positions(backbone: nn.Module) -> bool:
    """Whether the model numbers positions itself from its images (Qwen2-VL's multimodal
    rotary positions): headkit then passes no ``position_ids`` of its own."""
    return callable(getattr(backbone, "get_rope_index", None))


def decorated_tie_last(module: nn.Module) -> bool | None:
    """Whether ``module.forward`` replaces ``hidden_states[-1]`` by ``last_hidden_state``, as
    its ``capture_outputs(tie_last_hidden_states=...)`` decorator says (None: not decorated).
    A config's ``tie_last_hidden_states`` overrides it (``stack_ties_last``)."""
    fn = type(module).forward
    for _ in range(16):  # the chain of functools.wraps decorators
        code = getattr(fn, "__code__", None)
        if code is not None and "tie_last_hidden_states" in code.co_freevars:
            cell = fn.__closure__[code.co_freevars.index("tie_last_hidden_states")]
            return bool(cell.cell_contents)
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return None
    return None


def stack_ties_last(module: nn.Module, config: Any, layers_path: str = "") -> tuple[bool, str]:
    """(whether HF's ``hidden_states[-1]`` of the stack at ``layers_path`` in ``module`` is a
    ``last_hidden_state`` rather than the last block's output, the path of the module whose
    ``last_hidden_state`` it then is: "" for ``module`` itself).

    The hidden states are recorded by the innermost module on the way to the stack whose
    forward is decorated with ``capture_outputs`` (the model itself, or its encoder as in
    DINOv2, or a vision-language model's language model); its config's
    ``tie_last_hidden_states`` or else its decorator decides. DINOv2's encoder records
    without tying, so its ``hidden_states[-1]`` is not the model's final-normed output. A
    stack no decorated module runs (hand-written stacks append the final output) ties.
    """
    parts = layers_path.split(".")[:-1] if layers_path else []
    for depth in range(len(parts), -1, -1):  # the innermost first
        path = ".".join(parts[:depth])
        recorder = module.get_submodule(path)
        decorated = decorated_tie_last(recorder)
        if decorated is not None:
            own = getattr(recorder, "config", None) if path else config
            configured = getattr(own, "tie_last_hidden_states", None)
            return (configured if isinstance(configured, bool) else decorated), path
    configured = getattr(config, "tie_last_hidden_states", None)
    return (configured if isinstance(configured, bool) else True), ""


def has_cls_token(backbone: nn.Module) -> bool:
    """Whether a vision model prepends a class token (ViT's ``cls_token``, CLIP's
    ``class_embedding``), so that "first" pooling reads it."""
    return any(
        name.rsplit(".", 1)[-1] in ("cls_token", "class_embedding")
        for name, _ in backbone.named_parameters()
    )


#: Parameters holding tokens a vision model puts before its patches: ViT's and DINOv2's
#: ``cls_token``, CLIP's ``class_embedding``, DeiT's ``distillation_token``, DINOv2's
#: ``register_tokens`` (each holds one token per row of ``hidden_size``).
_SPECIAL_TOKEN_PARAMS = ("cls_token", "class_embedding", "distillation_token", "register_tokens")


def special_token_count(backbone: nn.Module, hidden_size: int) -> int:
    """How many leading positions of a vision model's hidden states are no image patch: its
    CLS token, DINOv2's ``num_register_tokens`` registers, DeiT's distillation token (0 for
    SigLIP, which has none). Read from the parameters holding them, so it holds for any
    model built that way ("patch_mean" pooling skips them)."""
    count = 0
    for name, param in backbone.named_parameters():
        if name.rsplit(".", 1)[-1] in _SPECIAL_TOKEN_PARAMS and param.shape[-1] == hidden_size:
            count += param.numel() // hidden_size
    return count


def pooler_of(model: nn.Module) -> nn.Module | None:
    """The module that makes a bare model's ``pooler_output`` from its states, if it has one:
    its ``pooler`` (BERT, ViT: dense + tanh over the first token) or an attention-pooling
    ``head`` (SigLIP's vision "MAP" head, whose class is named ``...PoolingHead``: a learned
    query attending to every patch). Other modules named ``head`` are not poolers."""
    pooler = getattr(model, "pooler", None)
    if isinstance(pooler, nn.Module):
        return pooler
    head = getattr(model, "head", None)
    if isinstance(head, nn.Module) and pools_every_position(head):
        return head
    return None


def stage_depths(config: Any) -> list[int] | None:
    """The blocks per stage of a hierarchical model (Swin's ``depths``: every stage merges
    patches, so its hidden states change length and width from stage to stage), or None
    for a model whose states all have one shape."""
    depths = getattr(config, "depths", None)
    if isinstance(depths, (list, tuple)) and depths and all(isinstance(d, int) for d in depths):
        return list(depths)
    return None


def default_pooling(modality: str, is_decoder: bool, has_cls: bool) -> str:
    """The pooling of a sequence head that names none (see the module's table)."""
    if is_decoder:  # causal: only the last position has seen everything
        return "last"
    if modality == "speech" or (modality == "vision" and not has_cls):
        return "mean"
    return "first"


def stack_length(config: Any, stack: str) -> int | None:
    """How many blocks the config gives an encoder–decoder model's ``stack``."""
    names = (
        ("encoder_layers", "num_layers", "num_hidden_layers")
        if stack == "encoder"
        else ("decoder_layers", "num_decoder_layers", "num_layers", "num_hidden_layers")
    )
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def language_model_class(config: Any) -> type:
    """The Auto class of the model with an LM head for ``config``: sequence-to-sequence
    (T5, BART), speech-to-text (Whisper), image-text-to-text (Llava, Qwen2-VL), else causal.
    (``AutoModelForCausalLM`` of an encoder–decoder config would build its decoder alone.)"""
    import transformers

    model_type = getattr(config, "model_type", None)
    causal = model_type in auto_model_types("CAUSAL_LM")
    for mapping, cls, unless_causal in (
        ("SEQ_TO_SEQ_CAUSAL_LM", "AutoModelForSeq2SeqLM", False),
        ("SPEECH_SEQ_2_SEQ", "AutoModelForSpeechSeq2Seq", False),
        ("IMAGE_TEXT_TO_TEXT", "AutoModelForImageTextToText", True),
    ):
        found = model_type in auto_model_types(mapping) and hasattr(transformers, cls)
        if found and not (unless_causal and causal):
            return getattr(transformers, cls)
    return transformers.AutoModelForCausalLM


def lm_logits_rule(task_model: nn.Module) -> tuple[float, torch.Tensor | None]:
    """How a task model turns its last hidden state into logits beyond its LM head:
    (a factor on the states, a bias added after): T5's ``scale_decoder_outputs``
    (``d_model ** -0.5``), BART's ``final_logits_bias``; (1.0, None) for most models."""
    config = getattr(task_model, "config", None)
    scale = 1.0
    if getattr(config, "scale_decoder_outputs", False):
        scale = float(config.d_model) ** -0.5
    bias = getattr(task_model, "final_logits_bias", None)
    return scale, bias if isinstance(bias, torch.Tensor) else None
