"""``load_headed``: build a HeadedModel from a path, hub id, model class or model object."""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import AutoModel, AutoModelForCausalLM, PreTrainedModel

from .config import HeadConfig
from .errors import CheckpointError, ConfigError, HeadkitError

# from_pretrained keyword arguments that are recorded with a referenced backbone (JSON-safe).
_RECORDED_KWARGS = ("gguf_file", "revision", "subfolder")


def _dtype_name(dtype: Any) -> str | None:
    if dtype is None or isinstance(dtype, str):
        return dtype
    return str(dtype).removeprefix("torch.")


def load_backbone(
    source: str | os.PathLike,
    *,
    torch_dtype: Any = None,
    device_map: Any = None,
    model_class: type | None = None,
    causal_lm: bool = False,
    **kwargs: Any,
) -> PreTrainedModel:
    """``from_pretrained`` with headkit's defaults; loading errors become CheckpointError."""
    cls = model_class or (AutoModelForCausalLM if causal_lm else AutoModel)
    if torch_dtype is not None:
        kwargs["dtype"] = (
            getattr(torch, torch_dtype)
            if isinstance(torch_dtype, str) and hasattr(torch, torch_dtype)
            else torch_dtype
        )
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        return cls.from_pretrained(str(source), **kwargs)
    except HeadkitError:
        raise
    # transformers and safetensors report missing, corrupt or mismatched files with many types
    except (
        OSError,
        ValueError,
        RuntimeError,
        TypeError,
        KeyError,
        EOFError,
        SafetensorError,
        pickle.UnpicklingError,  # a referenced *.bin that torch.load(weights_only=True) refuses
    ) as e:
        raise CheckpointError(f"cannot load a backbone from {str(source)!r}: {e}") from None


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
):
    """Load a backbone and attach heads.

    ``model`` is a local path or hub id, an already-built ``PreTrainedModel``, or (as in
    transformer-heads) a model class followed by the path: ``load_headed(LlamaForCausalLM,
    path, head_configs=[...])``. ``head_folder_path`` restores heads saved with
    ``save_pretrained`` (their configs are used when ``head_configs`` is None).
    ``freeze_base_model`` freezes the backbone; heads train according to ``trainable``.
    """
    from .checkpoint import (
        backbone_fingerprint,
        load_head_weights,
        read_head_weights,
        read_manifest,
    )
    from .model import HeadedModel

    if isinstance(model_name, (list, tuple)):
        if head_configs is not None:
            raise ConfigError("head_configs given twice (positionally and by keyword)")
        head_configs, model_name = model_name, None
    manifest = read_manifest(head_folder_path) if head_folder_path is not None else None
    if manifest is not None:
        head_state = read_head_weights(head_folder_path, manifest)  # fail fast, before loading
        saved = manifest["heads"]
        if head_configs is None:
            head_configs = saved
        else:
            given = sorted(
                c.name if isinstance(c, HeadConfig) else c.get("name") for c in head_configs
            )
            if given != sorted(c.name for c in saved):
                raise ConfigError(
                    f"head_configs {given} do not match the heads saved in "
                    f"{str(head_folder_path)!r} ({sorted(c.name for c in saved)})"
                )
    if head_configs is None:
        raise ConfigError("load_headed needs head_configs or head_folder_path")
    configs = [HeadConfig.from_dict(c) if isinstance(c, dict) else c for c in head_configs]
    wants_lm = any(c.name == "lm_head" and c.is_causal_lm for c in configs)

    source: str | None = None
    if isinstance(model, type):
        if not issubclass(model, PreTrainedModel):
            raise ConfigError(f"model class {model.__name__} is not a transformers PreTrainedModel")
        if model_name is None:
            raise ConfigError(f"load_headed({model.__name__}, ...) needs the model path or id next")
        source = str(model_name)
        hf = load_backbone(
            source,
            torch_dtype=torch_dtype,
            device_map=device_map,
            model_class=model,
            **from_pretrained_kwargs,
        )
    elif isinstance(model, (str, os.PathLike)):
        source = str(model)
        hf = load_backbone(
            source,
            torch_dtype=torch_dtype,
            device_map=device_map,
            causal_lm=wants_lm,
            **from_pretrained_kwargs,
        )
    elif isinstance(model, PreTrainedModel):
        hf = model
    else:
        raise ConfigError(
            f"model={type(model).__name__} is invalid; a path, hub id, PreTrainedModel class "
            "or PreTrainedModel"
        )
    headed = HeadedModel(hf, configs, freeze_base_model=freeze_base_model)
    if manifest is not None:
        weighting = dict(manifest.get("loss_weighting") or {"name": "fixed"})
        try:
            headed.set_loss_weighting(weighting.pop("name", "fixed"), **weighting)
        except TypeError as e:
            raise CheckpointError(f"{head_folder_path}: invalid loss_weighting: {e}") from None
        load_head_weights(headed, head_state, str(head_folder_path))
    if source is not None:
        if Path(source).exists():
            source = str(Path(source).resolve())
        recorded = {
            k: from_pretrained_kwargs[k] for k in _RECORDED_KWARGS if k in from_pretrained_kwargs
        }
        headed.backbone_source = {
            "source": source,
            "kwargs": recorded,
            "dtype": _dtype_name(torch_dtype),
        }
        headed.backbone_fingerprint = backbone_fingerprint(headed.backbone)
    if only_inference:
        headed.eval().requires_grad_(False)
    return headed
