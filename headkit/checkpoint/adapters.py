"""LoRA adapters and quantised backbones in checkpoints.

A checkpoint of a CheckpointModel whose backbone carries a LoRA adapter holds what was trained::

    adapter-<token>/adapter_model.safetensors   the adapter, keyed as peft writes it
    adapter-<token>/adapter_config.json          its LoraConfig, targets resolved to exact names

next to the heads, and the base backbone referenced (path or hub id, and its bitsandbytes
quantisation config, so a 4-bit base reloads 4-bit) — or copied without the adapter when the
base itself was trained, changed or built in memory. The folder is a plain peft adapter:
``PeftModel.from_pretrained(AutoModel.from_pretrained(base), "ckpt/adapter-<token>")`` loads it.

Reading is strict: the adapter is injected from its config, and the tensors the injection
created must be exactly the tensors in the file (names, shapes, finite values), read back
after loading; a backbone that carries adapters the checkpoint does not hold is refused.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from ..backbone.adapters import (
    adapter_modules,
    adapter_names,
    has_adapters,
    inject_adapter,
    split_names,
)
from ..errors import CheckpointError, ConfigError
from .journal import write_marker
from .manifest import MANIFEST, fsync_file, sha256_file
from .paths import check_tree_inside

if TYPE_CHECKING:
    from .contract import CheckpointModel

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # how peft keys a PeftModel's adapter tensors on disk
#: The largest LoRA rank an adapter in a checkpoint may declare (ranks in practice: 4 to 256).
MAX_LORA_RANK = 4096


# ---------------------------------------------------------------------- writing
def write_adapter(model: CheckpointModel, root: Path, token: str) -> dict[str, Any] | None:
    """Write the backbone's LoRA adapter to ``root/adapter-<token>/`` (None: it has none)."""
    backbone = model.backbone
    if not has_adapters(backbone):
        return None
    from peft import get_peft_model_state_dict

    configs = backbone.__dict__.get("peft_config") or {}
    names = sorted(adapter_names(backbone))
    if len(names) != 1 or names != sorted(configs):
        raise CheckpointError(
            f"the backbone carries adapters {names} (peft configs for {sorted(configs)}); a "
            "headkit checkpoint holds one LoRA adapter: delete the others (delete_adapter) "
            "or merge them first"
        )
    ((name, config),) = configs.items()
    source = model.source.source if model.source is not None else None
    config = _resolved_config(backbone, name, config, source)
    state = get_peft_model_state_dict(backbone, adapter_name=name, save_embedding_layers=False)
    state = {PEFT_PREFIX + k: v.detach().contiguous().cpu() for k, v in state.items()}
    folder = f"adapter-{token}"
    tmp = root / f".tmp-{folder}"
    tmp.mkdir()
    write_marker(tmp, token)  # first: a folder without it is never deleted
    save_file(state, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config.save_pretrained(str(tmp))
    checksums = {}
    for f in (tmp / ADAPTER_WEIGHTS, tmp / ADAPTER_CONFIG):
        os.chmod(f, 0o644)  # safetensors creates files readable by the owner only
        fsync_file(f)
        checksums[f.name] = sha256_file(f)
    os.replace(tmp, root / folder)
    return {"path": folder, "name": name, "files_sha256": checksums}


def _resolved_config(backbone: torch.nn.Module, name: str, config: Any, source: str | None):
    """The adapter's config with its targets as exact module names of the backbone (however
    they were given: suffixes, a regex, names inside a task model), so that injecting it into
    a freshly loaded backbone recreates exactly these layers."""
    peft_type = getattr(getattr(config, "peft_type", None), "value", None)
    if peft_type != "LORA":
        raise CheckpointError(
            f"adapter {name!r} has peft_type={peft_type!r}; headkit checkpoints hold LoRA "
            "adapters (save others with peft's own save_pretrained)"
        )
    config = copy.deepcopy(config)
    layers = {n: m for n, m in adapter_modules(backbone).items() if _holds(m, name)}
    tuners = {n: m for n, m in layers.items() if hasattr(m, "base_layer")}
    config.target_modules = sorted(tuners)
    config.modules_to_save = sorted(set(layers) - set(tuners)) or None
    config.layers_to_transform = config.layers_pattern = config.exclude_modules = None
    config.rank_pattern = {
        re.escape(n): m.r[name] for n, m in tuners.items() if m.r[name] != config.r
    }
    config.alpha_pattern = {
        re.escape(n): m.lora_alpha[name]
        for n, m in tuners.items()
        if m.lora_alpha[name] != config.lora_alpha
    }
    config.task_type = None  # the heads are the task
    config.inference_mode = True  # as peft writes it; loading decides
    config.base_model_name_or_path = source
    return config


def _holds(layer: torch.nn.Module, name: str) -> bool:
    if hasattr(layer, "base_layer"):
        return name in getattr(layer, "r", {})
    return name in getattr(layer, "modules_to_save", {})


# ---------------------------------------------------------------------- reading
def verify_adapter_files(root: Path, manifest: dict[str, Any]) -> None:
    """Check the manifest's adapter entry and its files' checksums (before anything loads)."""
    entry = manifest.get("adapter")
    if entry is None:
        return
    where = f"{root / MANIFEST}"
    path, name, sums = (
        entry.get(k) if isinstance(entry, dict) else None for k in ("path", "name", "files_sha256")
    )
    if not isinstance(path, str) or not path.startswith("adapter-") or {"/", "\\"} & set(path):
        raise CheckpointError(
            f"{where}: adapter.path={path!r} is invalid; the name of an 'adapter-*' folder"
        )
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{where}: adapter.name={name!r} is invalid; an adapter name")
    if not isinstance(sums, dict) or set(sums) != {ADAPTER_WEIGHTS, ADAPTER_CONFIG}:
        raise CheckpointError(
            f"{where}: adapter.files_sha256={sums!r} is invalid; checksums of "
            f"{ADAPTER_WEIGHTS} and {ADAPTER_CONFIG}"
        )
    if (root / path).is_dir():  # a symlink leading elsewhere is refused, as a backbone's is
        check_tree_inside(root / path, root, "adapter folder")
    for file, expected in sums.items():
        f = root / path / file
        if not f.is_file():
            raise CheckpointError(f"adapter file {str(f)!r} named in {MANIFEST} is missing")
        if sha256_file(f) != expected:
            raise CheckpointError(
                f"adapter file {str(f)!r} is corrupt or truncated (sha256 differs from {MANIFEST})"
            )


def load_adapter(backbone: torch.nn.Module, ckpt: Any, *, trainable: bool = True) -> None:
    """Load the checkpoint's LoRA adapter into ``backbone``, strictly: injected from its config
    when the backbone has none yet, then every adapter tensor is checked and read back."""
    entry = ckpt.manifest.get("adapter")
    where = str(ckpt.root)
    own = sorted(adapter_names(backbone))
    if entry is None:
        if own:
            raise CheckpointError(
                f"{where!r} holds no LoRA adapter, but the model's backbone carries adapters "
                f"{own}: loading would leave them as they are"
            )
        return
    name, folder = entry["name"], ckpt.root / entry["path"]
    state = _read_weights(folder / ADAPTER_WEIGHTS)
    state = {k.removeprefix(PEFT_PREFIX): v for k, v in state.items()}
    if not own:
        _inject(backbone, _read_config(folder), name, trainable, where, state)
    elif own != [name]:
        raise CheckpointError(
            f"{where!r} holds the adapter {name!r}, but the model's backbone carries {own}"
        )
    _load_state(backbone, state, name, where)


def _read_config(folder: Path) -> Any:
    from peft import PeftConfig

    try:
        config = PeftConfig.from_pretrained(str(folder))
    except (ValueError, TypeError, KeyError, OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"adapter config in {str(folder)!r} cannot be read: {e}") from None
    peft_type = getattr(getattr(config, "peft_type", None), "value", None)
    if peft_type != "LORA":
        raise CheckpointError(
            f"{str(folder / ADAPTER_CONFIG)!r}: peft_type={peft_type!r} is invalid; 'LORA'"
        )
    for field in ("megatron_config", "layer_replication"):  # they import code or reshape the model
        if getattr(config, field, None):
            raise CheckpointError(
                f"{str(folder / ADAPTER_CONFIG)!r}: {field}={getattr(config, field)!r} is not "
                "supported in headkit checkpoints; allowed: null"
            )
    return config


def _inject(
    backbone: torch.nn.Module, config: Any, name: str, trainable: bool, where: str, state: dict
) -> None:
    check_ranks(backbone, config, where, state)  # before peft allocates anything
    config.inference_mode = not trainable
    config.init_lora_weights = True  # the file's tensors replace them; no init touches the base
    config.base_model_name_or_path = None
    config.task_type = None
    try:
        inject_adapter(backbone, config, name)
    except (ValueError, TypeError, KeyError, RuntimeError, AttributeError) as e:
        raise CheckpointError(f"{where!r}: its adapter does not fit the backbone: {e}") from None


def check_ranks(backbone: torch.nn.Module, config: Any, where: str, state: dict) -> None:
    """Refuse LoRA ranks beyond MAX_LORA_RANK, and a rank that is not the one of the adapter's
    saved tensors (``lora_A`` is (r, in)), before peft allocates r × (n + m) values per
    layer: what peft builds is then never larger than the file that was read."""
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.other import get_pattern_key

    patterns = dict(getattr(config, "rank_pattern", None) or {})
    for field, r in [("r", config.r), *((f"rank_pattern[{k!r}]", v) for k, v in patterns.items())]:
        if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= MAX_LORA_RANK:
            raise CheckpointError(
                f"{where!r}: its adapter's {field}={r!r} is invalid; a LoRA rank from 1 to "
                f"{MAX_LORA_RANK}"
            )
    saved = {
        k.split(".lora_A.")[0]: v.shape[0]
        for k, v in state.items()
        if ".lora_A." in k and v.dim() >= 1
    }
    for key, module in backbone.named_modules():
        weight = getattr(getattr(module, "base_layer", module), "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() < 2:
            continue
        if not check_target_module_exists(config, key):
            continue
        r = patterns.get(get_pattern_key(list(patterns), key), config.r) if patterns else config.r
        if key in saved and r != saved[key]:
            raise CheckpointError(
                f"{where!r}: its adapter's config gives layer {key!r} rank {r}, but its saved "
                f"lora_A tensor has rank {saved[key]}: {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} "
                "do not belong together"
            )


def _load_state(backbone: torch.nn.Module, state: dict, name: str, where: str) -> None:
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    expected = get_peft_model_state_dict(backbone, adapter_name=name, save_embedding_layers=False)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: the adapter does not match the model's LoRA layers: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}"
        )
    for k, v in state.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise CheckpointError(
                f"{where}: adapter tensor {k!r} has shape {tuple(v.shape)}, but the model's is "
                f"{tuple(expected[k].shape)}"
            )
        if not v.is_floating_point():
            raise CheckpointError(
                f"{where}: adapter tensor {k!r} has dtype {v.dtype}; a floating-point dtype is "
                "expected"
            )
        if not bool(torch.isfinite(v).all()):
            raise CheckpointError(f"{where}: adapter tensor {k!r} holds NaN or infinite values")
    result = set_peft_model_state_dict(backbone, state, adapter_name=name)
    _, adapter_keys = split_names(backbone, list(backbone.state_dict()))
    missing = sorted(k for k in result.missing_keys if k in adapter_keys)
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"{where}: peft left adapter tensors unloaded: missing {missing[:5]}, unexpected "
            f"{sorted(result.unexpected_keys)[:5]}"
        )
    loaded = get_peft_model_state_dict(backbone, adapter_name=name, save_embedding_layers=False)
    wrong = [k for k, v in state.items() if not torch.equal(loaded[k], v.to(loaded[k]))]
    if wrong:
        raise CheckpointError(f"{where}: adapter tensors {wrong[:5]} did not load as saved")


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises plain Exception subclasses
        raise CheckpointError(f"adapter file {str(path)!r} cannot be read: {e}") from None


# ---------------------------------------------------------------------- quantisation
def quantization_entry(backbone: torch.nn.Module) -> dict[str, Any] | None:
    """The backbone's bitsandbytes quantisation config as JSON (None when not quantised so):
    what a referenced 4-bit base needs to reload 4-bit."""
    q = getattr(getattr(backbone, "config", None), "quantization_config", None)
    if q is None:
        return None
    d = q.to_dict() if hasattr(q, "to_dict") else dict(q)
    d = json.loads(json.dumps(d, default=str))
    return d if _method(d) == "bitsandbytes" else None


def _method(q: Any) -> str | None:
    m = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return getattr(m, "value", m)


def require_quantization_support(quantization_config: Any) -> None:
    """A bitsandbytes config needs a CUDA device and the bitsandbytes package: say which is
    missing before anything is loaded."""
    if quantization_config is None or _method(quantization_config) != "bitsandbytes":
        return
    missing = []
    if not torch.cuda.is_available():
        missing.append("a CUDA device (torch.cuda.is_available() is False)")
    if importlib.util.find_spec("bitsandbytes") is None:
        missing.append("the bitsandbytes package (pip install 'headkit[qlora]')")
    if missing:
        raise ConfigError(
            "quantization_config=BitsAndBytesConfig(...) is invalid here: 4-bit/8-bit "
            f"bitsandbytes loading needs a CUDA device and the bitsandbytes package; missing: "
            f"{' and '.join(missing)}. Without quantisation (quantization_config=None) LoRA "
            "trains on any device"
        )


def backbone_load_kwargs(ckpt: Any, kwargs: dict[str, Any], device_map: Any) -> tuple[dict, Any]:
    """``from_pretrained`` keywords for the checkpoint's backbone: its recorded quantisation
    (a given ``quantization_config`` wins; ``False`` loads unquantised), checked before loading."""
    kwargs = dict(kwargs)
    recorded = ckpt.backbone.get("quantization") if ckpt.backbone["kind"] == "reference" else None
    if recorded is not None and not isinstance(recorded, dict):
        raise CheckpointError(
            f"{ckpt.root / MANIFEST}: backbone.quantization={recorded!r} is invalid; a "
            "bitsandbytes config (a JSON object) or absent"
        )
    q = kwargs.pop("quantization_config", None)
    if q is False:
        return kwargs, device_map
    q = q if q is not None else recorded
    if q is None:
        return kwargs, device_map
    if isinstance(q, dict):
        q = _bnb_config(q, ckpt.root / MANIFEST)
    require_quantization_support(q)
    kwargs["quantization_config"] = q
    if device_map is None:
        device_map = {"": torch.cuda.current_device()}
    return kwargs, device_map


def _bnb_config(d: dict, where: Path) -> Any:
    from transformers import BitsAndBytesConfig

    if _method(d) != "bitsandbytes":
        raise CheckpointError(
            f"{where}: backbone.quantization={d!r} is invalid; a bitsandbytes config"
        )
    try:
        return BitsAndBytesConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: backbone.quantization is invalid: {e}") from None
