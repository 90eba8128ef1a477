"""LoRA and QLoRA with heads: one call to create, adapters-only checkpoints, exact reload.

``create_headed_qlora`` loads a backbone (4-bit with a ``BitsAndBytesConfig``, plain
otherwise), injects LoRA adapters into it and attaches full-precision heads:

    model = create_headed_qlora(LlamaForCausalLM, path, quantization_config=bnb,
                                lora_config=LoraConfig(r=16), head_configs=[...])
    ...train...
    model.save_pretrained("run")        # the adapter + the heads, the base referenced
    again = load_lora_with_heads("run")  # same predictions

Adapters go into every linear layer of the blocks that run before the deepest hooked layer
(later blocks never run with early exit, so they could not learn); never into the heads,
which stay float32 and train fully. ``merge_and_unload`` folds the adapters into the
weights. ``peft.get_peft_model(headed_model, config)`` works too: the heads and the loss
weighting become trained copies saved in the adapter (``heads_to_save`` lists them).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..backbone.adapters import adapter_modules, inject_adapter, merge_adapters
from ..checkpoint import read_checkpoint, restore
from ..checkpoint.adapters import require_quantization_support
from ..config import HeadConfig
from ..errors import CheckpointError, ConfigError
from ..loading import load_headed
from ..model.head_inputs import reached_blocks
from ..model.headed import HeadedModel

DEFAULT_LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.05}


def create_headed_qlora(
    model_name_or_path: str | os.PathLike,
    quantization_config: Any = None,
    lora_config: Any = None,
    head_configs: Sequence[HeadConfig | dict] | None = None,
    fully_trained_heads: bool = True,
    gradient_checkpointing: bool = False,
    torch_dtype: Any = torch.float32,
    *,
    model_class: type | None = None,
    train_lm_head: bool = True,
    device_map: Any = None,
    adaptive_loss: bool = False,
    **kwargs: Any,
) -> HeadedModel:
    """A backbone with LoRA adapters (4-bit when ``quantization_config`` is a
    ``BitsAndBytesConfig``; plain LoRA when None) and float32 heads, ready to train.

    ``model_name_or_path`` is loaded with ``model_class`` when given (a transformers class).
    ``lora_config`` (a ``peft.LoraConfig``; default r=8, alpha=16, dropout 0.05) is copied;
    without ``target_modules`` it targets every linear layer of the blocks before the deepest
    hooked layer (never the heads: a pretrained ``lm_head`` trains here as a head). Heads
    train (``fully_trained_heads=False`` freezes them all; only the adapters train); a
    pretrained ``lm_head`` head trains unless ``train_lm_head=False``.
    ``gradient_checkpointing`` recomputes the backbone's blocks in the backward pass.
    ``adaptive_loss=True`` is ``set_loss_weighting("adaptive")``. Defaults are headkit's:
    float32, ``device_map=None`` (the current CUDA device with quantisation). Other keywords
    go to ``from_pretrained``. ``headkit.create_headed_qlora`` is an adapter from the edge
    that also accepts transformer-heads' call forms (``headkit/compat/calls.py``).
    """
    if head_configs is None:
        raise ConfigError(
            "create_headed_qlora: head_configs=None is invalid; a list of HeadConfig",
            field="head_configs",
            value=None,
        )
    o = {
        "fully_trained_heads": fully_trained_heads,
        "lora_config": lora_config,
        "gradient_checkpointing": gradient_checkpointing,
        "adaptive_loss": adaptive_loss,
        "torch_dtype": torch_dtype,
        "quantization_config": quantization_config,
        "device_map": device_map,
    }
    quantization_config, device_map = o["quantization_config"], o["device_map"]
    require_quantization_support(quantization_config)  # before anything is loaded
    peft = _import_peft()
    configs = [_head_config(c, o["fully_trained_heads"], train_lm_head) for c in head_configs]
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
        if device_map is None:
            device_map = {"": torch.cuda.current_device()}
    model = load_headed(
        model_name_or_path,
        head_configs=configs,
        model_class=model_class,
        torch_dtype=o["torch_dtype"],
        device_map=device_map,
        **kwargs,
    )
    if o["adaptive_loss"]:
        model.set_loss_weighting("adaptive")
    lora_config = o["lora_config"]
    config = (
        copy.deepcopy(lora_config) if lora_config is not None else peft.LoraConfig(**DEFAULT_LORA)
    )
    config.task_type = None  # the heads are the task
    if config.layers_to_transform is not None and not config.layers_pattern:
        # peft's default pattern needs a parent before the block list ("model.layers.3"); the
        # backbone's names start at it ("layers.3"): name the list
        config.layers_pattern = model.info.layers_path.rsplit(".", 1)[-1]
    if config.target_modules is None:
        config.target_modules = default_lora_targets(model)
        config.fan_in_fan_out = _all_conv1d(model.backbone, config.target_modules)
    add_lora(model, config)
    if o["gradient_checkpointing"]:
        enable_gradient_checkpointing(model)
    return model


def add_lora(model: HeadedModel, lora_config: Any, adapter_name: str = "default") -> HeadedModel:
    """Inject LoRA adapters into ``model.backbone`` in place (the base stays as frozen as it
    was; the adapters train); ``lora_config.target_modules`` name backbone modules."""
    _import_peft()
    try:
        inject_adapter(model.backbone, lora_config, adapter_name)
    except (ValueError, TypeError, KeyError) as e:  # peft's own errors: targets not found, ...
        raise ConfigError(f"lora_config does not fit the backbone: {e}") from None
    wanted = set(lora_config.modules_to_save or [])
    found = {n.rsplit(".", 1)[-1] for n, m in adapter_modules(model.backbone).items()}
    unmatched = sorted(w for w in wanted if w.rsplit(".", 1)[-1] not in found)
    if unmatched:
        raise ConfigError(
            f"lora_config.modules_to_save={sorted(wanted)}: {unmatched} name no module of the "
            f"backbone ({type(model.backbone).__name__}); heads train as heads already "
            "(fully_trained_heads), leave them out"
        )
    return model


def default_lora_targets(model: HeadedModel) -> list[str]:
    """Names of every linear layer (``nn.Linear``, GPT-2's ``Conv1D``, bitsandbytes layers) in
    the backbone's blocks that run before the deepest hooked layer (an encoder–decoder
    model's whole encoder and its decoder up to there, for heads on its decoder)."""
    deepest = max(model.hooked_layers().values(), default=0)
    names = [
        f"{prefix}.{i}.{name}"
        for prefix, blocks in reached_blocks(model.info, model.state_keys().values())
        for i, block in enumerate(blocks)
        for name, m in block.named_modules()
        if name and _is_linear(m)
    ]
    if not names:
        raise ConfigError(
            f"no linear layer of the backbone runs before the deepest hooked layer "
            f"(layer_hook index {deepest}; 0 = the embeddings): LoRA would adapt nothing; hook "
            "a deeper layer or set lora_config.target_modules"
        )
    return names


def _is_linear(m: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(m, (nn.Linear, Conv1D))


def _all_conv1d(backbone: nn.Module, names: list[str]) -> bool:
    from transformers.pytorch_utils import Conv1D

    return all(isinstance(backbone.get_submodule(n), Conv1D) for n in names)


def enable_gradient_checkpointing(model: HeadedModel) -> None:
    """Recompute the backbone's blocks in the backward pass (non-reentrant, so gradients reach
    LoRA weights in the deepest hooked block even when the forward stops there)."""
    backbone = model.backbone
    kwargs = {"use_reentrant": False}
    if hasattr(backbone, "activation_checkpointing_enable"):  # its name since transformers 5.23.0
        backbone.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    backbone.enable_input_require_grads()


def load_lora_with_heads(
    path: str | os.PathLike,
    quantization_config: Any = None,
    only_inference: bool = False,
    fully_trained_heads: bool = True,
    device_map: Any = None,
    torch_dtype: Any = None,
    gradient_checkpointing: bool = False,
    *,
    model_class: type | None = None,
    **kwargs: Any,
) -> HeadedModel:
    """Load a checkpoint saved from a LoRA model (any registered format that holds an
    adapter): the base backbone it references (4-bit again if it was;
    ``quantization_config`` overrides, ``False`` loads it unquantised), its adapter and heads,
    with the same predictions. ``model_class`` (a transformers class) must match the
    checkpoint's backbone (``GPT2Model`` for a Llama checkpoint is a ConfigError); a format
    that records no class loads its backbone with it. ``headkit.load_lora_with_heads`` also
    accepts a model class first (``headkit/compat/calls.py``).

    ``only_inference=True``: every parameter frozen, eval mode. Otherwise the adapter trains,
    and the heads (their ``trainable`` ones) unless ``fully_trained_heads=False``. Defaults:
    the checkpoint's dtype and device.
    """
    if path is None:
        raise TypeError("load_lora_with_heads() missing the checkpoint path")
    ckpt = read_checkpoint(path)
    if ckpt.manifest.get("adapter") is None:
        raise CheckpointError(
            f"{str(path)!r} holds no LoRA adapter; load it with HeadedModel.from_pretrained"
        )
    model = restore(
        ckpt,
        model_cls=HeadedModel,
        only_inference=only_inference,
        torch_dtype=torch_dtype,
        device_map=device_map,
        quantization_config=quantization_config,
        model_class=model_class,
        **kwargs,
    )
    if not fully_trained_heads:
        model.heads.requires_grad_(False)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model


def merge_and_unload(model: HeadedModel) -> HeadedModel:
    """Merge the LoRA adapters into the backbone's weights and remove them (in place): a
    plain HeadedModel with the same predictions. Merging into 4-bit weights rounds."""
    merge_adapters(model)
    return model


def heads_to_save(model: HeadedModel) -> list[str]:
    """``modules_to_save`` for ``peft.get_peft_model(model, LoraConfig(...))``: each head and a
    loss weighting with state (headkit adds them by itself; this spells the recipe out)."""
    names = [f"heads.{name}" for name in model.head_configs]
    if any(True for _ in model.loss_weighting.state_dict()):
        names.append("loss_weighting")
    return names


def _head_config(cfg: HeadConfig | dict, fully_trained: bool, train_lm_head: bool) -> HeadConfig:
    cfg = HeadConfig.from_dict(cfg) if isinstance(cfg, dict) else cfg
    frozen = not fully_trained or (cfg.name == "lm_head" and cfg.is_causal_lm and not train_lm_head)
    return cfg.replace(trainable=False) if frozen else cfg


def _check_source(first: Any, second: Any, fn: str) -> None:
    if isinstance(first, type):
        if second is None:
            raise ConfigError(f"{fn}({first.__name__}, ...) needs the model path or id next")
    elif second is not None:
        raise ConfigError(
            f"{fn}({str(first)!r}, {str(second)!r}): give a model class and a path, or a path"
        )


def _import_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ConfigError("LoRA needs the peft package: pip install 'headkit[peft]'") from None
    return peft
