"""transformer-heads' call forms of the loaders, adapted to headkit's.

transformer-heads calls ``load_headed(LlamaForCausalLM, path, head_configs, ...)`` and
``create_headed_qlora(LlamaForCausalLM, path, bnb_config, lora_config, ...)``: a model class
first, then its own positional order (``TH_ORDER``, ``TH_QLORA_ORDER``), also by its keyword
names (``base_model_class=``, ``model_name=``). Here those calls are bound to keywords and
passed to headkit's loaders (``headkit.loading.load_headed``,
``headkit.integrations.peft.create_headed_qlora``), which know no other library. A call
without a model class first keeps headkit's order (``HEADKIT_ORDER``, ``QLORA_ORDER``).
``headkit.load_headed``, ``headkit.create_headed_qlora`` and ``headkit.load_lora_with_heads``
are these adapters, so both call forms work from ``headkit`` and from ``headkit.compat``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from ..config import HeadConfig
from ..errors import ConfigError
from ..formats import is_checkpoint_folder
from ..integrations import peft as _peft
from ..loading import load_headed as _load_headed
from ..model.headed import HeadedModel

#: transformer-heads' positional order, used when the first argument is a model class.
TH_ORDER = (
    "model_name",
    "head_configs",
    "head_folder_path",
    "only_inference",
    "device_map",
    "quantization_config",
    "freeze_base_model",
    "adaptive_loss",
    "torch_dtype",
)
#: headkit's positional order, used otherwise.
HEADKIT_ORDER = (
    "model_name",
    "head_configs",
    "head_folder_path",
    "freeze_base_model",
    "only_inference",
    "torch_dtype",
    "device_map",
)
#: transformer-heads' positional order of ``create_headed_qlora`` (first argument a class).
TH_QLORA_ORDER = (
    "model_name",
    "quantization_config",
    "lora_config",
    "head_configs",
    "fully_trained_heads",
    "device_map",
    "gradient_checkpointing",
    "adaptive_loss",
    "torch_dtype",
)
#: headkit's positional order of ``create_headed_qlora``.
QLORA_ORDER = (
    "model_name",
    "quantization_config",
    "lora_config",
    "head_configs",
    "fully_trained_heads",
    "gradient_checkpointing",
    "torch_dtype",
)

#: load_headed's keyword defaults that are not None.
_DEFAULTS = {"freeze_base_model": True, "only_inference": False, "adaptive_loss": False}
#: create_headed_qlora's keyword defaults that are not None.
_QLORA_DEFAULTS = {
    "fully_trained_heads": True,
    "gradient_checkpointing": False,
    "torch_dtype": torch.float32,
    "adaptive_loss": False,
}


def load_headed(
    model: str | os.PathLike | type | PreTrainedModel | None = None,
    *args: Any,
    model_name: str | os.PathLike | Sequence[HeadConfig] | None = None,
    head_configs: Sequence[HeadConfig | dict] | None = None,
    head_folder_path: str | os.PathLike | None = None,
    freeze_base_model: bool = True,
    only_inference: bool = False,
    torch_dtype: Any = None,
    device_map: Any = None,
    quantization_config: Any = None,
    adaptive_loss: bool = False,
    base_model_class: type | None = None,
    **from_pretrained_kwargs: Any,
) -> HeadedModel:
    """Load a backbone and attach heads (``headkit.loading.load_headed``), in either call form.

    ``load_headed(path_or_model, head_configs, ...)`` is headkit's form (``HEADKIT_ORDER``);
    ``load_headed(LlamaForCausalLM, path, head_configs=[...])`` transformer-heads' (its
    positional order ``TH_ORDER`` when the first argument is a model class, or its keywords
    ``base_model_class=``, ``model_name=``). The model-class form loads a backbone in float32
    unless a dtype is given, as transformer-heads did (headkit's form: transformers' default,
    the checkpoint's dtype). Everything else is headkit's ``load_headed``.
    """
    given = {
        "model_name": model_name,
        "head_configs": head_configs,
        "head_folder_path": head_folder_path,
        "freeze_base_model": freeze_base_model,
        "only_inference": only_inference,
        "torch_dtype": torch_dtype,
        "device_map": device_map,
        "quantization_config": quantization_config,
        "adaptive_loss": adaptive_loss,
    }
    model = _first_argument(model, base_model_class, "load_headed")
    th_form = isinstance(model, type)
    o = bind_positional(
        "load_headed", args, TH_ORDER if th_form else HEADKIT_ORDER, given, _DEFAULTS
    )
    second = o.pop("model_name")
    if isinstance(second, (list, tuple)):  # load_headed(path, [heads])
        if o["head_configs"] is not None:
            raise ConfigError("head_configs given twice (positionally and by keyword)")
        o["head_configs"], second = second, None
    if not th_form:
        return _load_headed(model, **o, **from_pretrained_kwargs)
    if not issubclass(model, PreTrainedModel):
        raise ConfigError(
            f"model class {model.__name__} is not a transformers PreTrainedModel",
            field="base_model_class",
            value=model,
        )
    if second is None:
        raise ConfigError(
            f"load_headed({model.__name__}, ...) needs the model path or id next",
            field="model_name",
            value=None,
        )
    restoring = o["head_configs"] is None and o["head_folder_path"] is None
    restoring = restoring and is_checkpoint_folder(second)
    if not restoring and o["torch_dtype"] is None and from_pretrained_kwargs.get("dtype") is None:
        o["torch_dtype"] = torch.float32  # transformer-heads' default
    return _load_headed(second, model_class=model, **o, **from_pretrained_kwargs)


def create_headed_qlora(
    base_model_class_or_path: type | str | os.PathLike | None = None,
    *args: Any,
    model_name_or_path: str | os.PathLike | Sequence[HeadConfig] | None = None,
    quantization_config: Any = None,
    lora_config: Any = None,
    head_configs: Sequence[HeadConfig | dict] | None = None,
    fully_trained_heads: bool = True,
    gradient_checkpointing: bool = False,
    torch_dtype: Any = torch.float32,
    train_lm_head: bool = True,
    device_map: Any = None,
    adaptive_loss: bool = False,
    base_model_class: type | None = None,
    model_name: str | os.PathLike | None = None,
    **kwargs: Any,
) -> HeadedModel:
    """headkit's ``create_headed_qlora`` (``integrations/peft.py``) in either call form:
    transformer-heads' ``create_headed_qlora(LlamaForCausalLM, path, ...)``, positionally in
    its order (``TH_QLORA_ORDER``) or by its keywords (``base_model_class=``, ``model_name=``,
    ...), or headkit's with the path first (``QLORA_ORDER``)."""
    given = {
        "model_name": _one_of(model_name, model_name_or_path, "model_name"),
        "quantization_config": quantization_config,
        "lora_config": lora_config,
        "head_configs": head_configs,
        "fully_trained_heads": fully_trained_heads,
        "gradient_checkpointing": gradient_checkpointing,
        "torch_dtype": torch_dtype,
        "device_map": device_map,
        "adaptive_loss": adaptive_loss,
    }
    first = _one_of(base_model_class, base_model_class_or_path, "base_model_class")
    order = TH_QLORA_ORDER if isinstance(first, type) else QLORA_ORDER
    o = bind_positional("create_headed_qlora", args, order, given, _QLORA_DEFAULTS)
    second = o.pop("model_name")
    if isinstance(second, (list, tuple)):  # create_headed_qlora(path, [heads])
        if o["head_configs"] is not None:
            raise ConfigError("head_configs given twice (positionally and by keyword)")
        o["head_configs"], second = second, None
    if o["head_configs"] is None:
        raise ConfigError(
            "create_headed_qlora: head_configs=None is invalid; a list of HeadConfig",
            field="head_configs",
            value=None,
        )
    _peft._check_source(first, second, "create_headed_qlora")
    model_class, path = (first, second) if isinstance(first, type) else (None, first)
    return _peft.create_headed_qlora(
        path, model_class=model_class, train_lm_head=train_lm_head, **o, **kwargs
    )


def load_lora_with_heads(
    base_model_class_or_path: type | str | os.PathLike | None = None,
    path: str | os.PathLike | None = None,
    *args: Any,
    base_model_class: type | None = None,
    **kwargs: Any,
) -> HeadedModel:
    """headkit's ``load_lora_with_heads`` (``integrations/peft.py``) in either call form:
    ``load_lora_with_heads(path, ...)`` or, as in transformer-heads (same positional order),
    ``load_lora_with_heads(LlamaForCausalLM, path, ...)`` / ``base_model_class=``; the class
    loads a transformer-heads checkpoint's backbone and must match a headkit checkpoint's."""
    first = _one_of(base_model_class, base_model_class_or_path, "base_model_class")
    model_class = None
    if isinstance(first, type):
        _peft._check_source(first, path, "load_lora_with_heads")
        model_class = first
    elif path is not None:
        raise ConfigError(
            f"load_lora_with_heads({str(first)!r}, {str(path)!r}): give the "
            "checkpoint path once (a model class may come first)",
            field="path",
            value=path,
        )
    else:
        path = first
    return _peft.load_lora_with_heads(path, *args, model_class=model_class, **kwargs)


def bind_positional(
    fn: str,
    args: tuple[Any, ...],
    order: Sequence[str],
    given: dict[str, Any],
    defaults: dict[str, Any],
) -> dict[str, Any]:
    """``given`` (the keyword values) with ``args`` placed by ``order``; a name whose keyword
    value is not its default (``defaults``, else None) and that a positional argument also
    fills is a TypeError, as Python's own calls raise."""
    if len(args) > len(order):
        raise TypeError(f"{fn}() takes at most {len(order) + 1} positional arguments")
    out = dict(given)
    for name, value in zip(order, args):
        if given.get(name) is not defaults.get(name):
            raise TypeError(f"{fn}() got multiple values for argument {name!r}")
        out[name] = value
    return out


def _first_argument(model: Any, base_model_class: Any, fn: str) -> Any:
    if base_model_class is not None:
        if model is not None:
            raise TypeError(f"{fn}() got multiple values for argument 'base_model_class'")
        return base_model_class
    if model is None:
        raise TypeError(f"{fn}() missing the model: a model class, path, hub id or model")
    return model


def _one_of(name: Any, alias: Any, what: str) -> Any:
    if name is not None and alias is not None:
        raise TypeError(f"{what} given twice (by its name and by the older one)")
    return name if name is not None else alias
