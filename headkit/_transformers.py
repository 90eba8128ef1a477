"""Every transformers name headkit uses that is not its public top-level API, in one place.

transformers moves its internals between 5.x minors (``slice_logits_to_keep`` appeared in
5.25, the KV cache's output field was renamed ``past_key_values`` → ``cache`` in 5.24, the
output-capturing registry changed its keys in 5.25). Each name here picks the form that works
on the installed version by feature detection (``try``/``except``, ``hasattr``), never by
parsing a version string, and falls back to headkit's own few lines where transformers has
nothing. ``tests/test_transformers_compat.py`` fails when a module of headkit imports a
non-top-level or private transformers name anywhere else. ``__all__`` lists what is here.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import transformers
from torch import nn
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_outputs import CausalLMOutputWithPast, Seq2SeqLMOutput
from transformers.pytorch_utils import Conv1D
from transformers.utils import ModelOutput
from transformers.utils.hub import convert_file_size_to_int

try:  # transformers >= 5.25
    from transformers.modeling_utils import slice_logits_to_keep as _slice_logits_to_keep
except ImportError:  # older: the same two lines, kept here
    _slice_logits_to_keep = None

try:  # transformers >= 5.2: hooks that record outputs, installed on the first call
    from transformers.utils import output_capturing as _capturing
except ImportError:  # older: hidden_states come without hooks to install
    _capturing = None

#: The names this module provides (checked by tests/test_transformers_compat.py).
__all__ = [
    "CACHE_FIELD",
    "CausalLMOutputWithPast",
    "Conv1D",
    "GenerationMode",
    "ModelOutput",
    "Seq2SeqLMOutput",
    "TRAINER_OVERRIDES",
    "auto_model_types",
    "cache_of",
    "can_record_outputs",
    "convert_file_size_to_int",
    "default_logging_level",
    "feat_extract_output_lengths",
    "feature_vector_attention_mask",
    "hooks_inside_checkpoint",
    "image_processor",
    "install_capturing_hooks",
    "is_auto_class",
    "logging",
    "model_output",
    "records_hidden_states",
    "resized_lm_head",
    "revert_weight_conversion",
    "slice_logits_to_keep",
]

#: transformers' logging (verbosity, progress bars): public as ``transformers.logging``.
logging = transformers.logging

#: The private ``Trainer`` methods ``HeadedTrainer`` overrides (its checkpoint format);
#: the tests check that the installed Trainer still calls each by this name.
TRAINER_OVERRIDES = (
    "_save",
    "_save_checkpoint",
    "_load_from_checkpoint",
    "_load_best_model",
    "_set_signature_columns_if_needed",
)

#: The name of the KV cache's field in model outputs: ``cache`` (transformers >= 5.24, which
#: keeps ``past_key_values`` as a deprecated alias) or ``past_key_values`` (older).
_OUTPUT_FIELDS = CausalLMOutputWithPast.__dataclass_fields__
CACHE_FIELD = "cache" if "cache" in _OUTPUT_FIELDS else "past_key_values"


@functools.cache
def hooks_inside_checkpoint() -> bool:
    """Whether activation checkpointing runs a block's module hooks inside the checkpoint: it
    checkpoints the block's ``__call__`` (transformers < 5.23) rather than its ``forward``.
    Under a reentrant checkpoint such hooks see no autograd graph, so a state they capture
    carries no gradient back into the backbone."""
    try:  # imported here: on some versions it imports code that imports scikit-learn
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return True
    return "__call__" in vars(GradientCheckpointingLayer)


def model_output(cls: type, cache: Any = None, **fields: Any) -> Any:
    """``cls(**fields)`` (a transformers ``ModelOutput`` class) with the KV cache under the
    field name the installed version uses."""
    return cls(**fields, **{CACHE_FIELD: cache})


def cache_of(out: Any) -> Any:
    """The KV cache of a model output: ``cache`` (transformers >= 5.24; its deprecated alias
    ``past_key_values`` warns) or ``past_key_values`` (older)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def slice_logits_to_keep(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions of ``hidden`` (batch, seq, width) whose logits a causal LM computes:
    the last ``logits_to_keep`` (0 = all), or the given indices (transformers' rule)."""
    if _slice_logits_to_keep is not None:
        return _slice_logits_to_keep(hidden, logits_to_keep)
    if isinstance(logits_to_keep, int):
        return hidden[:, slice(-logits_to_keep, None), :]
    return hidden[:, logits_to_keep, :]


def auto_model_types(mapping: str) -> frozenset[str]:
    """The model types of one of transformers' Auto mappings by its name without the
    ``MODEL_FOR_`` prefix and ``_MAPPING_NAMES`` suffix (``"CAUSAL_LM"``); empty when the
    installed version has no such mapping."""
    # imported here: on some versions it imports generation code that imports scikit-learn
    from transformers.models.auto import modeling_auto

    return frozenset(getattr(modeling_auto, f"MODEL_FOR_{mapping}_MAPPING_NAMES", None) or ())


def is_auto_class(cls: Any) -> bool:
    """Whether ``cls`` is an Auto class (``AutoModelForCausalLM``): it has a model mapping."""
    return getattr(cls, "_model_mapping", None) is not None


def can_record_outputs(cls: type) -> dict:
    """The outputs a model class records by hooks (its ``_can_record_outputs``), {} if none."""
    return getattr(cls, "_can_record_outputs", None) or {}


def records_hidden_states(module: nn.Module) -> bool:
    """Whether transformers records ``module``'s ``hidden_states`` by hooks it installs on
    the first ``output_hidden_states=True`` call (False on versions without such hooks)."""
    registry = getattr(_capturing, "_CAN_RECORD_REGISTRY", None)
    if registry is None or not hasattr(_capturing, "maybe_install_capturing_hooks"):
        return False
    flags = registry.get(module)  # >= 5.25: keyed by the model
    if flags is None:  # older: a plain dict keyed by the class's name
        flags = registry.get(str(module.__class__))
    return bool((flags or {}).get("hidden_states"))


def install_capturing_hooks(module: nn.Module) -> None:
    """Install transformers' output-capturing hooks on ``module`` now, as its first
    ``output_hidden_states=True`` call would (a no-op where there are none)."""
    install = getattr(_capturing, "maybe_install_capturing_hooks", None)
    if install is not None:
        install(module)


def _method(model: nn.Module, name: str) -> Any:
    """``name`` on the model, else on its encoder (Whisper keeps it there)."""
    found = getattr(model, name, None)
    if found is None and hasattr(model, "get_encoder"):
        found = getattr(model.get_encoder(), name, None)
    return found


def feat_extract_output_lengths(model: nn.Module) -> Any:
    """A speech model's samples → frames function (its ``_get_feat_extract_output_lengths``),
    None for a model without one."""
    return _method(model, "_get_feat_extract_output_lengths")


def feature_vector_attention_mask(model: nn.Module) -> Any:
    """A speech model's own sample mask → frame mask reduction (its
    ``_get_feature_vector_attention_mask(num_frames, mask)``), None for a model without one."""
    return _method(model, "_get_feature_vector_attention_mask")


def resized_lm_head(model: Any, old: nn.Linear, new: int, mean_resizing: bool) -> nn.Linear:
    """``old`` with ``new`` output rows, as transformers resizes an LM head: kept rows
    copied, added rows from the old rows' mean and covariance (``mean_resizing``) or the
    model's init (its ``_get_resized_lm_head``)."""
    return model._get_resized_lm_head(old, new, mean_resizing=mean_resizing)


def image_processor(source: str, **kwargs: Any) -> Any:
    """The image processor saved in folder ``source`` (``AutoImageProcessor``). Where that
    needs torchvision and it is missing (transformers < 5.25 builds the torchvision-backed
    class by default), the PIL-backed class the config names (``<type>Pil``)."""
    import json
    from pathlib import Path

    try:
        return transformers.AutoImageProcessor.from_pretrained(source, **kwargs)
    except ImportError:
        path = Path(source, "preprocessor_config.json")
        if not path.is_file():  # what AutoImageProcessor says where it runs
            raise OSError(f"{source} does not appear to have a file named {path.name}") from None
        kind = json.loads(path.read_text()).get("image_processor_type", "")
        pil = getattr(transformers, kind.removesuffix("Fast") + "Pil", None) if kind else None
        if pil is None:
            raise
        return pil.from_pretrained(source, **kwargs)


def revert_weight_conversion(model: nn.Module, state: dict) -> dict:
    """``state`` (``model``'s tensors) under the names ``save_pretrained`` writes:
    transformers renames some families' weights when loading and back when saving
    (``core_model_loading``); where it has no such step, the names are as saved."""
    try:
        from transformers.core_model_loading import revert_weight_conversion as revert
    except ImportError:
        return state
    return revert(model, state)


def default_logging_level() -> int:
    """transformers' default verbosity (``TRANSFORMERS_VERBOSITY`` or warning)."""
    find = getattr(logging, "_get_default_logging_level", None)
    return find() if find is not None else logging.WARNING
