"""``load_headed``: build a HeadedModel from a path, hub id, model class or model object."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from .backbone.safety import check_model_class
from .backbone.sources import (
    BackboneSource,
    is_sentence_transformer,
    load_backbone,
    requested_dtype,
    source_of,
    transformer_folder,
    transformers_model_of,
)
from .checkpoint import read_checkpoint, restore
from .checkpoint.adapters import require_quantization_support
from .checkpoint.paths import is_checkpoint
from .checkpoint.transformer_heads import is_transformer_heads_checkpoint
from .config import HeadConfig
from .errors import ConfigError
from .model.headed import HeadedModel

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
    """Load a backbone and attach heads.

    ``model`` is a local path or hub id, an already-built ``PreTrainedModel``, a
    ``SentenceTransformer`` or the folder of a saved one (its Transformer module's model is the
    backbone), or (as in transformer-heads) a model class followed by the path:
    ``load_headed(LlamaForCausalLM, path, head_configs=[...])``, also by its keyword names
    (``base_model_class=``, ``model_name=``). Positional arguments follow transformer-heads'
    order (``TH_ORDER``) when the first is a model class, headkit's (``HEADKIT_ORDER``)
    otherwise. ``head_folder_path`` restores a checkpoint written by ``save_pretrained`` (or
    by transformer-heads) onto that backbone (its heads, loss weighting, settings and, if it
    holds one, its fine-tuned backbone weights or adapter), through the same path as
    ``HeadedModel.from_pretrained``; its head configs are used when ``head_configs`` is None.
    A checkpoint folder given as the model without head configs is restored as
    ``HeadedModel.from_pretrained`` does.

    ``freeze_base_model`` freezes the backbone; heads train according to ``trainable``;
    ``only_inference=True`` freezes every parameter and puts the model in eval mode.
    ``adaptive_loss=True`` is ``set_loss_weighting("adaptive")``. ``quantization_config`` (a
    ``BitsAndBytesConfig``, CUDA only) loads the backbone quantised, frozen. ``dtype=``
    (transformers 5) and ``torch_dtype=`` are the same option; ``"auto"`` is recorded as the
    dtype it resolved to. Defaults are headkit's (``device_map=None``: one device; its
    ``"auto"`` is accepted and on the CPU places everything there), except that the
    model-class form loads a backbone in float32 unless a dtype is given, as transformer-heads
    did (headkit's form: transformers' default, the checkpoint's dtype).
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
    model_name, head_configs = o["model_name"], o["head_configs"]
    if isinstance(model_name, (list, tuple)):
        if head_configs is not None:
            raise ConfigError("head_configs given twice (positionally and by keyword)")
        head_configs, model_name = model_name, None
    kwargs = from_pretrained_kwargs
    o["torch_dtype"] = requested_dtype(o["torch_dtype"], kwargs)
    if _quantization(o["quantization_config"], kwargs, o) and o["device_map"] is None:
        o["device_map"] = {"": torch.cuda.current_device()}
    folder, adaptive = o["head_folder_path"], o["adaptive_loss"]
    checkpoint = model_name if th_form else model
    if head_configs is None and folder is None and _is_any_checkpoint(checkpoint):
        headed = restore(
            checkpoint,
            model_cls=HeadedModel,
            freeze_base_model=o["freeze_base_model"],
            only_inference=o["only_inference"],
            torch_dtype=o["torch_dtype"],
            device_map=o["device_map"],
            model_class=model if th_form else None,
            **kwargs,
        )
        return _adapt_loss(headed, adaptive)
    return _adapt_loss(_build(model, model_name, head_configs, folder, o, kwargs), adaptive)


def _build(
    model: Any,
    model_name: Any,
    head_configs: Any,
    folder: Any,
    o: dict[str, Any],
    kwargs: dict[str, Any],
) -> HeadedModel:
    """load_headed with head configs or a head folder: load the backbone, build, restore."""
    ckpt = read_checkpoint(folder) if folder is not None else None
    if ckpt is not None:
        head_configs = _checkpoint_heads(ckpt.heads, head_configs, folder)
    if head_configs is None:
        raise ConfigError("load_headed needs head_configs or head_folder_path")
    configs = [HeadConfig.from_dict(c) if isinstance(c, dict) else c for c in head_configs]
    wants_lm = any(c.name == "lm_head" and c.is_causal_lm for c in configs)
    torch_dtype = o["torch_dtype"]
    if isinstance(model, type) and torch_dtype is None:
        torch_dtype = torch.float32  # transformer-heads' default
    hf, source = _backbone(model, model_name, wants_lm, torch_dtype, o["device_map"], kwargs)
    headed = HeadedModel(
        hf,
        configs,
        freeze_base_model=o["freeze_base_model"],
        loss_weighting=ckpt.weighting if ckpt is not None else "fixed",
        nonfinite_loss=ckpt.nonfinite_loss if ckpt is not None else "raise",
        layers_path=ckpt.manifest.get("layers_path") if ckpt is not None else None,
        source=source,
    )
    if ckpt is not None:
        restore(ckpt, model=headed)
    if o["only_inference"]:
        headed.eval().requires_grad_(False)
    return headed


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


#: load_headed's keyword defaults that are not None.
_DEFAULTS = {"freeze_base_model": True, "only_inference": False, "adaptive_loss": False}


def _first_argument(model: Any, base_model_class: Any, fn: str) -> Any:
    if base_model_class is not None:
        if model is not None:
            raise TypeError(f"{fn}() got multiple values for argument 'base_model_class'")
        return base_model_class
    if model is None:
        raise TypeError(f"{fn}() missing the model: a model class, path, hub id or model")
    return model


def _is_any_checkpoint(path: Any) -> bool:
    return isinstance(path, (str, os.PathLike)) and (
        is_checkpoint(path) or is_transformer_heads_checkpoint(path)
    )


def _quantization(config: Any, kwargs: dict[str, Any], o: dict[str, Any]) -> bool:
    """Put a quantisation config into the loading keywords, checked first (CUDA, frozen)."""
    if config is None:
        return False
    require_quantization_support(config)
    if not (o["freeze_base_model"] or o["only_inference"]):
        raise ConfigError(
            "quantization_config with freeze_base_model=False is invalid: quantised weights "
            "do not train; freeze the base (train LoRA adapters with create_headed_qlora)"
        )
    kwargs["quantization_config"] = config
    return True


def _adapt_loss(model: HeadedModel, adaptive: bool) -> HeadedModel:
    if adaptive and getattr(model.loss_weighting, "name", None) != "adaptive":
        model.set_loss_weighting("adaptive")
    return model


def _checkpoint_heads(
    saved: list[HeadConfig], given: Sequence[HeadConfig | dict] | None, where: Any
) -> Sequence[HeadConfig | dict]:
    if given is None:
        return saved
    names = sorted(c.name if isinstance(c, HeadConfig) else c.get("name") for c in given)
    if names != sorted(c.name for c in saved):
        raise ConfigError(
            f"head_configs {names} do not match the heads saved in {str(where)!r} "
            f"({sorted(c.name for c in saved)})"
        )
    return given


def _backbone(
    model: Any,
    model_name: Any,
    causal_lm: bool,
    torch_dtype: Any,
    device_map: Any,
    kwargs: dict[str, Any],
) -> tuple[PreTrainedModel, BackboneSource | None]:
    """The backbone ``load_headed`` was asked for, and where it came from (if loaded here)."""
    if isinstance(model, type):
        if not issubclass(model, PreTrainedModel):
            raise ConfigError(f"model class {model.__name__} is not a transformers PreTrainedModel")
        if model_name is None:
            raise ConfigError(f"load_headed({model.__name__}, ...) needs the model path or id next")
        where, how = model_name, {"model_class": model}
        config = os.path.join(os.fspath(model_name), "config.json")
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                check_model_class(model, json.load(f).get("model_type"), model_name)
    elif isinstance(model, (str, os.PathLike)):
        where = transformer_folder(model) if os.path.isdir(model) else model
        how = {"causal_lm": causal_lm}
    else:
        model = transformers_model_of(model) if is_sentence_transformer(model) else model
        if isinstance(model, PreTrainedModel):
            return model, None
        raise ConfigError(
            f"model={type(model).__name__} is invalid; a path, hub id, PreTrainedModel class "
            "or PreTrainedModel"
        )
    hf = load_backbone(str(where), torch_dtype=torch_dtype, device_map=device_map, **how, **kwargs)
    return hf, source_of(hf, where, torch_dtype, kwargs)
