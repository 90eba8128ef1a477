"""peft adapter layers inside a model: finding them, the base weights under them, freezing
around them, merging them away.

peft injects an adapter by replacing a module with a *tuner layer* that keeps the original as
``base_layer`` (``c_attn`` → ``c_attn.base_layer`` + ``c_attn.lora_A.default`` ...), and wraps
``modules_to_save`` in a wrapper that keeps the original as ``original_module`` plus a trained
copy. The *base view* of a model is its state dict with the adapters left out and the original
names restored: what the model was before peft touched it. peft is imported only when it
already is: without it there can be no adapter layers.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

#: peft task types that pass a HeadedModel its own inputs (others pass ``labels=`` or need
#: generation methods a HeadedModel does not have).
HEADED_TASK_TYPES = (None, "FEATURE_EXTRACTION")


def _peft_classes() -> tuple[type, type] | None:
    """(BaseTunerLayer, AuxiliaryTrainingWrapper) when peft is imported, else None."""
    if sys.modules.get("peft") is None:
        return None
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return BaseTunerLayer, AuxiliaryTrainingWrapper


def adapter_modules(module: nn.Module) -> dict[str, nn.Module]:
    """The outermost adapter layers of ``module`` by name: tuner layers (LoRA, ...) and
    trained-copy wrappers (``modules_to_save``)."""
    classes = _peft_classes()
    if classes is None:
        return {}
    found: dict[str, nn.Module] = {}
    for name, m in module.named_modules():
        if isinstance(m, classes) and not any(name.startswith(f"{p}.") for p in found):
            found[name] = m
    return found


def has_adapters(module: nn.Module) -> bool:
    return bool(adapter_modules(module))


def adapter_names(module: nn.Module) -> set[str]:
    """The names of the adapters the layers of ``module`` hold (whatever ``peft_config`` says)."""
    names: set[str] = set()
    for layer in adapter_modules(module).values():
        if hasattr(layer, "base_layer"):
            for attr in layer.adapter_layer_names:
                names.update(getattr(layer, attr, {}).keys())
        else:
            names.update(getattr(layer, "modules_to_save", {}).keys())
    return names


def _inner_name(layer: nn.Module) -> str:
    """Where an adapter layer keeps the module it replaced."""
    return "base_layer" if hasattr(layer, "base_layer") else "original_module"


def split_names(module: nn.Module, keys: list[str]) -> tuple[dict[str, str], set[str]]:
    """Sort state-dict (or parameter) ``keys`` of ``module`` into base keys, mapped to their
    names before peft (``c_attn.base_layer.weight`` → ``c_attn.weight``), and adapter keys."""
    layers = adapter_modules(module)
    base: dict[str, str] = {}
    adapter: set[str] = set()
    for key in keys:
        prefix = next((p for p in layers if key.startswith(f"{p}.")), None)
        if prefix is None:
            base[key] = key
            continue
        rest = key[len(prefix) + 1 :]
        inner = _inner_name(layers[prefix])
        if rest.startswith(f"{inner}."):
            base[key] = f"{prefix}.{rest[len(inner) + 1 :]}"
        else:
            adapter.add(key)
    return base, adapter


def base_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` without adapter tensors, under the names it had before peft
    (the tensors share storage with the model's: copying into them loads the model)."""
    state = module.state_dict()
    base, _ = split_names(module, list(state))
    return {name: state[key] for key, name in base.items()}


def base_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters that are not the adapters' (all of them when there are none)."""
    params = dict(module.named_parameters())
    base, _ = split_names(module, list(params))
    return [params[k] for k in base]


def freeze_base(module: nn.Module) -> None:
    """Freeze every parameter except the adapters' (which keep their ``requires_grad``)."""
    for p in base_parameters(module):
        p.requires_grad_(False)


def inject_adapter(module: nn.Module, config: Any, adapter_name: str = "default") -> None:
    """Inject peft adapters into ``module`` in place, as ``get_peft_model`` does for a new one
    (adapter dtype autocast, gradient-checkpointing set-up), except that the base parameters
    keep their ``requires_grad`` (peft would freeze them all)."""
    from peft import get_peft_model

    before = {id(p): p.requires_grad for p in module.parameters()}
    with warnings.catch_warnings():  # peft reads a property transformers 5 deprecates
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        get_peft_model(module, config, adapter_name=adapter_name)
    for p in base_parameters(module):
        p.requires_grad_(before.get(id(p), False))


def adapter_configs(model: nn.Module, backbone: nn.Module) -> dict[str, Any] | None:
    """The peft configs of the adapters in ``backbone`` (found on the model peft wrapped, or on
    the backbone itself); None when the backbone has no adapters."""
    if not has_adapters(backbone):
        return None
    for holder in (backbone, model):
        configs = holder.__dict__.get("peft_config")
        if isinstance(configs, Mapping) and configs:
            return dict(configs)
    return None


def unwrap_peft_model(model: Any) -> Any:
    """A ``PeftModel``'s adapted model (its adapters stay injected); anything else unchanged."""
    if sys.modules.get("peft") is None:
        return model
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return model
    config = model.peft_config[model.active_adapter]
    if config.is_prompt_learning:
        raise ConfigError(
            f"model is a PeftModel with peft_type={config.peft_type.value!r}, a prompt-learning "
            "method (virtual tokens, not layers in the backbone); HeadedModel takes adapters "
            "injected into the backbone's layers, such as LoRA"
        )
    return model.get_base_model()


def adopt_adapters(model: nn.Module, backbone: nn.Module) -> None:
    """Check that every adapter layer of ``model`` lies in ``backbone`` (what a HeadedModel
    keeps) and give the backbone the adapters' peft configs, which its checkpoints record."""
    inside = {id(m) for m in backbone.modules()}
    outside = sorted(n for n, m in adapter_modules(model).items() if id(m) not in inside)
    if outside:
        raise ConfigError(
            f"adapter layers outside the backbone ({type(backbone).__name__}) would be dropped "
            f"by HeadedModel: {outside[:5]}; target only the backbone's modules (heads are "
            "trained as heads)"
        )
    if not has_adapters(backbone):
        return
    configs = adapter_configs(model, backbone)
    if configs is None:
        raise ConfigError(
            f"{type(backbone).__name__} holds adapter layers but no peft_config describes them; "
            "inject adapters with peft (get_peft_model or inject_adapter_in_model)"
        )
    backbone.__dict__.setdefault("peft_config", configs)


def merge_adapters(root: nn.Module) -> int:
    """Merge every active adapter into the weights under it and put the plain modules back
    (peft's ``merge_and_unload``, for any module); returns the number of layers merged."""
    layers = adapter_modules(root)
    for name, layer in layers.items():
        parent_name, _, child = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        if hasattr(layer, "unload_and_optionally_merge_module"):
            plain = layer.unload_and_optionally_merge_module(
                merge=True, safe_merge=False, adapter_names=None
            )
        else:
            layer.merge()
            plain = layer.get_base_layer()
        setattr(parent, child, plain)
    for m in root.modules():
        m.__dict__.pop("peft_config", None)
    return len(layers)


def keep_heads_in_adapter(model: Any, configs: Mapping[str, Any]) -> None:
    """What ``peft.get_peft_model(headed_model, config)`` needs from a HeadedModel: every head,
    and a loss weighting with state, become trained copies saved in the adapter (peft's
    ``modules_to_save``). peft froze them a moment before; heads keep their ``trainable``."""
    from peft.utils import ModulesToSaveWrapper

    for adapter, config in configs.items():
        task = getattr(config, "task_type", None)
        task = getattr(task, "value", task)
        if task not in HEADED_TASK_TYPES:
            raise ConfigError(
                f"peft task_type={task!r} is for transformers task models (it passes labels= "
                "and needs generation methods); a HeadedModel's heads are its task: leave "
                "task_type=None (the adapters of this call are already injected: build the "
                "model again)"
            )
        targets = {f"heads.{name}": name for name in model.head_configs}
        if any(True for _ in model.loss_weighting.state_dict()):
            targets["loss_weighting"] = None
        added = []
        for path, head in targets.items():
            module = model.get_submodule(path)
            if isinstance(module, ModulesToSaveWrapper):
                continue  # peft wrapped it already (it was in modules_to_save)
            wrapper = ModulesToSaveWrapper(module, adapter)
            wrapper.set_adapter(adapter, inference_mode=config.inference_mode)
            if head is not None and not model.head_configs[head].trainable:
                wrapper.modules_to_save[adapter].requires_grad_(False)
            parent, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, wrapper)
            added.append(path)
        if added:
            config.modules_to_save = sorted({*(config.modules_to_save or []), *added})
