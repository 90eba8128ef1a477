"""``load_headed``: build a HeadedModel from a path, hub id, model class or model object."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedModel

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
from .checkpoint.paths import is_checkpoint
from .config import HeadConfig
from .errors import ConfigError
from .model.headed import HeadedModel


def load_headed(
    model: str | os.PathLike | type | PreTrainedModel,
    model_name: str | os.PathLike | Sequence[HeadConfig] | None = None,
    head_configs: Sequence[HeadConfig | dict] | None = None,
    head_folder_path: str | os.PathLike | None = None,
    freeze_base_model: bool = True,
    only_inference: bool = False,
    torch_dtype: Any = None,
    device_map: Any = None,
    **from_pretrained_kwargs: Any,
) -> HeadedModel:
    """Load a backbone and attach heads.

    ``model`` is a local path or hub id, an already-built ``PreTrainedModel``, a
    ``SentenceTransformer`` or the folder of a saved one (its Transformer module's model is the
    backbone), or (as in
    transformer-heads) a model class followed by the path: ``load_headed(LlamaForCausalLM,
    path, head_configs=[...])``. ``head_folder_path`` restores a checkpoint written by
    ``save_pretrained`` onto that backbone (its heads, loss weighting, settings and, if it
    holds one, its fine-tuned backbone weights), through the same path as
    ``HeadedModel.from_pretrained``; its head configs are used when ``head_configs`` is None.
    ``freeze_base_model`` freezes the backbone; heads train according to ``trainable``.
    A headkit checkpoint folder given as ``model`` without head configs is restored as
    ``HeadedModel.from_pretrained`` does. ``dtype=`` (transformers 5) and ``torch_dtype=``
    are the same option; ``"auto"`` is recorded as the dtype it resolved to.
    """
    if isinstance(model_name, (list, tuple)):
        if head_configs is not None:
            raise ConfigError("head_configs given twice (positionally and by keyword)")
        head_configs, model_name = model_name, None
    torch_dtype = requested_dtype(torch_dtype, from_pretrained_kwargs)
    if (
        head_configs is None
        and head_folder_path is None
        and isinstance(model, (str, os.PathLike))
        and is_checkpoint(model)
    ):
        return restore(
            model,
            model_cls=HeadedModel,
            freeze_base_model=freeze_base_model,
            only_inference=only_inference,
            torch_dtype=torch_dtype,
            device_map=device_map,
            **from_pretrained_kwargs,
        )
    ckpt = read_checkpoint(head_folder_path) if head_folder_path is not None else None
    if ckpt is not None:
        head_configs = _checkpoint_heads(ckpt.heads, head_configs, head_folder_path)
    if head_configs is None:
        raise ConfigError("load_headed needs head_configs or head_folder_path")
    configs = [HeadConfig.from_dict(c) if isinstance(c, dict) else c for c in head_configs]
    wants_lm = any(c.name == "lm_head" and c.is_causal_lm for c in configs)
    hf, source = _backbone(
        model, model_name, wants_lm, torch_dtype, device_map, from_pretrained_kwargs
    )
    headed = HeadedModel(
        hf,
        configs,
        freeze_base_model=freeze_base_model,
        loss_weighting=ckpt.weighting if ckpt is not None else "fixed",
        nonfinite_loss=ckpt.nonfinite_loss if ckpt is not None else "raise",
        layers_path=ckpt.manifest.get("layers_path") if ckpt is not None else None,
        source=source,
    )
    if ckpt is not None:
        restore(ckpt, model=headed)
    if only_inference:
        headed.eval().requires_grad_(False)
    return headed


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
