"""``load_headed``: build a HeadedModel from a path, hub id or model object."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
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
from .checkpoint import MANIFEST, read_checkpoint, restore
from .checkpoint.adapters import require_quantization_support
from .checkpoint.manifest import trainer_state_dict_heads
from .checkpoint.restore import load_trainer_state
from .config import HeadConfig
from .errors import ConfigError
from .formats import is_checkpoint_folder
from .model.headed import HeadedModel


def load_headed(
    model: str | os.PathLike | PreTrainedModel,
    head_configs: Sequence[HeadConfig | dict] | None = None,
    head_folder_path: str | os.PathLike | None = None,
    freeze_base_model: bool = True,
    only_inference: bool = False,
    torch_dtype: Any = None,
    device_map: Any = None,
    *,
    model_class: type | None = None,
    quantization_config: Any = None,
    adaptive_loss: bool = False,
    **from_pretrained_kwargs: Any,
) -> HeadedModel:
    """Load a backbone and attach heads.

    ``model`` is a local path or hub id, an already-built ``PreTrainedModel``, a
    ``SentenceTransformer`` or the folder of a saved one (its Transformer module's model is the
    backbone); ``model_class`` (a transformers class) loads the path with that class instead of
    headkit's choice. ``head_folder_path`` restores a checkpoint (any registered format,
    ``formats.py``) onto that backbone (its heads, loss weighting, settings and, if
    it holds one, its fine-tuned backbone weights or adapter), through the same path as
    ``HeadedModel.from_pretrained``; its head configs are used when ``head_configs`` is None.
    A checkpoint folder given as the model without head configs is restored as
    ``HeadedModel.from_pretrained`` does.

    ``freeze_base_model`` freezes the backbone; heads train according to ``trainable``;
    ``only_inference=True`` freezes every parameter and puts the model in eval mode.
    ``adaptive_loss=True`` is ``set_loss_weighting("adaptive")``. ``quantization_config`` (a
    ``BitsAndBytesConfig``, CUDA only) loads the backbone quantised, frozen. ``dtype=``
    (transformers 5) and ``torch_dtype=`` are the same option; ``"auto"`` is recorded as the
    dtype it resolved to. Defaults are headkit's (``device_map=None``: one device; its
    ``"auto"`` is accepted and on the CPU places everything there). ``headkit.load_headed``
    is an adapter from the edge that accepts other libraries' call forms and calls this.
    """
    o = {
        "freeze_base_model": freeze_base_model,
        "only_inference": only_inference,
        "device_map": device_map,
    }
    kwargs = from_pretrained_kwargs
    torch_dtype = requested_dtype(torch_dtype, kwargs)
    if _quantization(quantization_config, kwargs, o) and o["device_map"] is None:
        o["device_map"] = {"": torch.cuda.current_device()}
    if head_configs is None and head_folder_path is None and is_checkpoint_folder(model):
        headed = restore(
            model,
            model_cls=HeadedModel,
            freeze_base_model=freeze_base_model,
            only_inference=only_inference,
            torch_dtype=torch_dtype,
            device_map=o["device_map"],
            model_class=model_class,
            **kwargs,
        )
        return _adapt_loss(headed, adaptive_loss)
    o["torch_dtype"] = torch_dtype
    built = _build(model, model_class, head_configs, head_folder_path, o, kwargs)
    return _adapt_loss(built, adaptive_loss)


def _build(
    model: Any,
    model_class: type | None,
    head_configs: Any,
    folder: Any,
    o: dict[str, Any],
    kwargs: dict[str, Any],
) -> HeadedModel:
    """load_headed with head configs or a head folder: load the backbone, build, restore (a
    plain Trainer's ``checkpoint-N`` folder: its state dict, onto the heads of ``head_configs``)."""
    trainer = _trainer_folder(folder) if head_configs is not None else False
    ckpt = read_checkpoint(folder) if folder is not None and not trainer else None
    if ckpt is not None:
        head_configs = _checkpoint_heads(ckpt.heads, head_configs, folder)
    if head_configs is None:
        raise ConfigError("load_headed needs head_configs or head_folder_path")
    configs = [HeadConfig.from_dict(c) if isinstance(c, dict) else c for c in head_configs]
    wants_lm = any(c.name == "lm_head" and c.is_causal_lm for c in configs)
    hf, source = _backbone(model, model_class, wants_lm, o["torch_dtype"], o["device_map"], kwargs)
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
    if trainer:
        load_trainer_state(headed, folder)
    if o["only_inference"]:
        headed.eval().requires_grad_(False)
    return headed


def _trainer_folder(folder: Any) -> bool:
    """Whether ``folder`` holds the state dict a plain Trainer saved from a HeadedModel (and no
    headkit manifest)."""
    if folder is None or not isinstance(folder, (str, os.PathLike)):
        return False
    root = Path(folder)
    return not (root / MANIFEST).exists() and bool(trainer_state_dict_heads(root))


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
    model_class: type | None,
    causal_lm: bool,
    torch_dtype: Any,
    device_map: Any,
    kwargs: dict[str, Any],
) -> tuple[PreTrainedModel, BackboneSource | None]:
    """The backbone ``load_headed`` was asked for, and where it came from (if loaded here)."""
    if model_class is not None:
        if not (isinstance(model_class, type) and issubclass(model_class, PreTrainedModel)):
            raise ConfigError(
                f"model class {getattr(model_class, '__name__', model_class)} is not a "
                "transformers PreTrainedModel",
                field="model_class",
                value=model_class,
            )
        if model is None or not isinstance(model, (str, os.PathLike)):
            raise ConfigError(
                f"load_headed({model_class.__name__}, ...) needs the model path or id next",
                field="model",
                value=model,
            )
        where, how = model, {"model_class": model_class}
        config = os.path.join(os.fspath(model), "config.json")
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                check_model_class(model_class, json.load(f).get("model_type"), model)
    elif isinstance(model, (str, os.PathLike)):
        where = transformer_folder(model) if os.path.isdir(model) else model
        how = {"causal_lm": causal_lm}
    else:
        model = transformers_model_of(model) if is_sentence_transformer(model) else model
        if isinstance(model, PreTrainedModel):
            return model, None
        raise ConfigError(
            f"model={type(model).__name__} is invalid; a path, hub id, PreTrainedModel class "
            "or PreTrainedModel",
            field="model",
            value=type(model).__name__,
        )
    hf = load_backbone(str(where), torch_dtype=torch_dtype, device_map=device_map, **how, **kwargs)
    return hf, source_of(hf, where, torch_dtype, kwargs)
