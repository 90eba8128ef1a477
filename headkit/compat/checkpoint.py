"""transformer-heads' checkpoints (0.2.x), read in place as headkit checkpoints.

Its saves carry no format version; three layouts are recognised (safetensors and JSON only; a
folder holding only pickles is refused):

- **full** (``save_pretrained`` of a ``load_headed`` model): ``config.json`` with
  ``output_heads`` (a list of HeadConfig field dicts), ``model.safetensors`` (or shards) with
  the backbone under its ``*ForCausalLM`` names and ``heads.<name>.lins.<i>.*``, and one
  ``<head>.safetensors`` per head;
- **lora** (``save_pretrained`` of a ``create_headed_qlora`` model): ``head_configs.json``
  mapping each head's name to its fields, ``<head>.safetensors`` (``lins.<i>.weight`` /
  ``.bias``), and peft's ``adapter_config.json`` + ``adapter_model.safetensors``; the base
  is ``base_model_name_or_path`` (as written, else beside the checkpoint, else a hub id);
- **heads** (its save of a quantised ``load_headed`` model): ``head_configs.json`` and the head
  files only; the backbone comes from the caller (``load_headed(cls, base, head_folder_path=)``).

The conversion: head configs keep their fields (sequence heads pool ``"last"``, the last
non-padding token it read); ``lins.<i>`` is the head's i-th Linear. A head named ``lm_head``
was never saved on its own by transformer-heads: it is the base's (or, in the LoRA layout, the
adapter's saved ``lm_head.base_layer``) LM head, with a LoRA adapter on it merged into the
head. The adapter's other layers are injected into the backbone, under the backbone's names.

``READER`` is registered in ``headkit.formats.READERS`` as ``"transformer-heads"``
(lazily, by ``headkit/__init__.py``): ``restore`` reads these folders through it and asks the
read checkpoint's ``format`` (a ``TransformerHeadsCheckpoint``) how to build and load it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file
from torch import nn

from ..backbone.adapters import adapter_names, base_state_dict
from ..backbone.inspection import base_model_of
from ..backbone.safety import check_model_class
from ..backbone.sources import load_backbone, source_of
from ..checkpoint.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    _inject,
    _load_state,
    _read_config,
)
from ..checkpoint.manifest import (
    MAX_MANIFEST_BYTES,
    PICKLE_SUFFIXES,
    check_head_count,
    short_repr,
)
from ..checkpoint.paths import MANIFEST, MAX_NAME, check_inside, plain_name
from ..checkpoint.restore import Checkpoint
from ..config import HeadConfig
from ..errors import CheckpointError, ConfigError
from ..heads.base import HEADS

if TYPE_CHECKING:
    from ..model.headed import HeadedModel

FORMAT = "transformer-heads"
LAYOUTS = ("full", "lora", "heads")
_CONFIG = "config.json"
_WEIGHTS = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_LM = "lm_head"


# ---------------------------------------------------------------------- detection
def detect(path: str | os.PathLike) -> str | None:
    """The transformer-heads layout of the folder ``path`` ("full", "lora", "heads"), or None
    (a headkit checkpoint, another folder, or nothing)."""
    root = Path(path)
    heads = _json(root / MANIFEST)
    if isinstance(heads, dict) and heads and "format" not in heads:
        if all(isinstance(v, dict) and "name" in v for v in heads.values()):
            return "lora" if (root / ADAPTER_CONFIG).is_file() else "heads"
        return None
    config = _json(root / _CONFIG)
    if isinstance(config, dict) and isinstance(config.get("output_heads"), list):
        return "full"
    return None


def is_transformer_heads_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder transformer-heads saved (any of its layouts)."""
    try:
        return detect(path) is not None
    except (OSError, ValueError):
        return False


def _json(path: Path) -> Any:
    try:
        if not path.is_file() or path.stat().st_size > MAX_MANIFEST_BYTES:
            return None  # (a headkit manifest that large is refused by read_manifest)
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None


# ---------------------------------------------------------------------- the checkpoint
@dataclass
class TransformerHeadsCheckpoint:
    """A read transformer-heads folder: the headkit manifest it amounts to, the heads' tensors
    under headkit's names, and what its backbone and adapter need to load."""

    root: Path
    layout: str
    manifest: dict[str, Any]
    head_state: dict[str, torch.Tensor]
    base: str | None = None  # lora: the base model; full: the folder itself
    adapter: dict[str, torch.Tensor] | None = None  # lora: keys without peft's prefix
    lm_keys: list[str] = field(default_factory=list)  # head-state keys of lm_head's Linear

    @property
    def where(self) -> str:
        return str(self.root)

    # ------------------------------------------------------------------ CheckpointFormat
    def build_backbone(
        self,
        ckpt: Checkpoint,
        model_class: type | None,
        torch_dtype: Any,
        device_map: Any,
        kwargs: dict[str, Any],
        trainable: bool,
    ) -> tuple[Any, Any]:
        backbone, source = self.load_backbone(model_class, torch_dtype, device_map, kwargs)
        self.load_adapter(base_model_of(backbone), trainable=trainable)
        return backbone, source

    def head_tensors(self, ckpt: Checkpoint, model: HeadedModel) -> dict[str, torch.Tensor]:
        return self.head_state_for(model)

    def load_backbone_into(self, ckpt: Checkpoint, model: HeadedModel) -> None:
        self.load_backbone_state(model.backbone)
        self.load_adapter(model.backbone, trainable=True)

    # ------------------------------------------------------------------ backbone
    def load_backbone(
        self,
        model_class: type | None,
        torch_dtype: Any,
        device_map: Any,
        kwargs: dict[str, Any],
    ) -> tuple[Any, Any]:
        """(backbone task model, its source) for building a model; the source is None for the
        full layout, so headkit checkpoints of it copy the backbone."""
        if self.layout == "heads":
            raise CheckpointError(
                f"{self.where!r} holds transformer-heads' heads only (its save of a quantised "
                "load_headed model), no backbone; load it onto one: load_headed(ModelClass, "
                f"base_model, head_folder_path={self.where!r})"
            )
        dtype = torch.float32 if torch_dtype is None else torch_dtype  # its default
        wants_lm = any(c.name == _LM for c in self.manifest["heads"])
        if self.layout == "lora":
            cls = model_class
            if cls is None:
                from transformers import AutoModel, AutoModelForCausalLM

                cls = AutoModelForCausalLM if wants_lm else AutoModel
            check_model_class(cls, _model_type(self.base), self.base)
            kwargs = {**kwargs, "use_safetensors": True}  # never weights from a pickle
            hf = load_backbone(
                self.base, model_class=cls, torch_dtype=dtype, device_map=device_map, **kwargs
            )
            return hf, source_of(hf, self.base, dtype, kwargs)
        return self._load_full(model_class, dtype, device_map, kwargs), None

    def _load_full(self, model_class: type | None, dtype: Any, device_map: Any, kwargs: dict):
        from transformers import AutoConfig, AutoModelForCausalLM

        cls = model_class or AutoModelForCausalLM
        config = AutoConfig.from_pretrained(str(self.root), trust_remote_code=False)
        check_model_class(cls, config.model_type, self.where)
        del config.output_heads
        config.architectures = None
        with _quiet_transformers():  # its heads.* tensors are reported as unexpected; checked here
            hf, info = load_backbone(
                self.root,
                model_class=cls,
                torch_dtype=dtype,
                device_map=device_map,
                config=config,
                use_safetensors=True,
                output_loading_info=True,
                **kwargs,
            )
        spare = (_LM + ".",) if _LM not in self._head_names() else ()
        missing = [k for k in info.get("missing_keys", []) if not k.startswith(spare or "\0")]
        unexpected = [
            k for k in info.get("unexpected_keys", []) if not k.startswith(("heads.", _LM + "."))
        ]
        if missing or unexpected or info.get("mismatched_keys") or info.get("error_msgs"):
            raise CheckpointError(
                f"{self.where!r}: the backbone in {_WEIGHTS} does not match its config.json: "
                f"missing {short_repr(sorted(missing)[:5], 300)}, unexpected "
                f"{short_repr(sorted(unexpected)[:5], 300)}, mismatched "
                f"{short_repr(list(info.get('mismatched_keys') or [])[:5], 300)}"
            )
        return hf

    def _head_names(self) -> set[str]:
        return {c.name for c in self.manifest["heads"]}

    def load_backbone_state(self, backbone: nn.Module) -> None:
        """Copy the full layout's backbone tensors into ``backbone`` (a bare model) in place,
        strictly; other layouts hold none."""
        if self.layout != "full":
            return
        state = {k: v for k, v in _read_weights(self.root).items() if not _is_head_key(k)}
        prefixes = {k.split(".", 1)[0] for k in state}
        own = base_state_dict(backbone)
        if len(prefixes) == 1 and not set(state) & set(own):
            prefix = prefixes.pop() + "."
            state = {k.removeprefix(prefix): v for k, v in state.items()}
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise CheckpointError(
                f"{self.where!r}: the backbone in {_WEIGHTS} does not match the model's: "
                f"missing {short_repr(missing[:5], 300)}, unexpected "
                f"{short_repr(unexpected[:5], 300)}"
            )
        with torch.no_grad():
            for k, v in state.items():
                if tuple(v.shape) != tuple(own[k].shape):
                    raise CheckpointError(
                        f"{self.where!r}: backbone tensor {short_repr(k)} has shape "
                        f"{tuple(v.shape)}, the model's {tuple(own[k].shape)}"
                    )
                own[k].copy_(v.to(own[k].device, own[k].dtype))

    # ------------------------------------------------------------------ adapter
    def load_adapter(self, backbone: nn.Module, trainable: bool) -> None:
        """Inject the LoRA layers the adapter holds inside the backbone and load them strictly
        (its ``lm_head`` part goes into the head instead: ``head_state_for``)."""
        own = sorted(adapter_names(backbone))
        if own:
            raise CheckpointError(
                f"{self.where!r}: the model's backbone carries adapters {own} already; load "
                "this transformer-heads checkpoint onto a backbone without adapters"
            )
        if self.adapter is None:
            return
        from transformers.pytorch_utils import Conv1D

        prefix = _prefix_of(self.adapter)
        state = {k.removeprefix(prefix): v for k, v in self.adapter.items() if not _is_head_key(k)}
        if not state:
            return
        config = _read_config(self.root)
        targets = sorted({k.split(".lora_")[0] for k in state if ".lora_" in k})
        try:
            modules = [backbone.get_submodule(t) for t in targets]
        except AttributeError as e:
            raise CheckpointError(
                f"{self.where!r}: its adapter targets modules the backbone "
                f"({type(backbone).__name__}) does not have: {e}"
            ) from None
        config.target_modules = targets  # exact names of the backbone's modules
        config.layers_to_transform = config.layers_pattern = config.exclude_modules = None
        config.fan_in_fan_out = all(isinstance(m, Conv1D) for m in modules)
        config.modules_to_save = None
        _inject(backbone, config, "default", trainable, self.where, state)
        _load_state(backbone, state, "default", self.where)

    # ------------------------------------------------------------------ heads
    def head_state_for(self, model: HeadedModel) -> dict[str, torch.Tensor]:
        """The head tensors to load into ``model``: the file's, with ``lm_head`` completed
        from the model's own LM head (the base's) and its LoRA delta merged in."""
        state = dict(self.head_state)
        if not self.lm_keys:
            return state
        own = model.head_state_dict()
        for key in self.lm_keys:
            if key not in state and key in own:
                state[key] = own[key].detach().clone()
        delta = self._lm_delta()
        if delta is not None:
            weight = next(k for k in self.lm_keys if k.endswith(".weight"))
            state[weight] = state[weight] + delta.to(state[weight])
        return state

    def _lm_delta(self) -> torch.Tensor | None:
        """The LoRA update of transformer-heads' lm_head, B @ A × scaling (None: none)."""
        if self.adapter is None or f"{_LM}.lora_A.weight" not in self.adapter:
            return None
        extra = sorted(
            k
            for k in self.adapter
            if k.startswith(_LM + ".")
            and k not in (f"{_LM}.lora_A.weight", f"{_LM}.lora_B.weight")
            and not k.startswith(f"{_LM}.base_layer.")
        )
        config = _read_config(self.root)
        if extra or getattr(config, "use_dora", False):
            raise CheckpointError(
                f"{self.where!r}: the adapter's lm_head part holds "
                f"{short_repr(extra, 300) if extra else 'DoRA weights'}; "
                "headkit merges plain LoRA (lora_A, lora_B) into the lm_head head only"
            )
        a = self.adapter[f"{_LM}.lora_A.weight"].double()  # (r, hidden)
        b = self.adapter[f"{_LM}.lora_B.weight"].double()  # (vocab, r)
        r = (config.rank_pattern or {}).get(_LM, config.r)
        alpha = (config.alpha_pattern or {}).get(_LM, config.lora_alpha)
        scaling = alpha / (r**0.5 if config.use_rslora else r)
        return (b @ a * scaling).float()


# ---------------------------------------------------------------------- the reader
class TransformerHeadsReader:
    """transformer-heads' folders as a ``CheckpointReader`` (``READERS["transformer-heads"]``)."""

    def detect(self, root: Path) -> bool:
        return is_transformer_heads_checkpoint(root)

    def read(self, root: Path) -> Checkpoint:
        found = read_transformer_heads(root)
        if found is None:
            raise CheckpointError(f"{str(root)!r} is not a transformer-heads checkpoint")
        return Checkpoint(root, found.manifest, found.head_state, format=found)


READER = TransformerHeadsReader()


# ---------------------------------------------------------------------- reading
def read_transformer_heads(path: str | os.PathLike) -> TransformerHeadsCheckpoint | None:
    """Read a transformer-heads folder (None when ``path`` is not one); CheckpointError when
    it is one that cannot be read."""
    root = Path(path)
    layout = detect(root)
    if layout is None:
        return None
    for name in (_CONFIG, MANIFEST, ADAPTER_CONFIG, _INDEX):
        _check_contained(root, name, name)
    if layout == "full":
        fields = _json(root / _CONFIG)["output_heads"]
        tensors = _read_weights(root)
        check_config_sizes(root, _json(root / _CONFIG), tensors)
    else:
        fields = list(_json(root / MANIFEST).values())
        tensors = {}
    check_head_count(len(fields), str(root))
    configs = [_head_config(f, root) for f in fields]
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise CheckpointError(f"{str(root)!r}: head names {names} are not unique")
    state: dict[str, torch.Tensor] = {}
    lm_keys: list[str] = []
    adapter = _read_adapter(root) if layout == "lora" else None
    for cfg in configs:
        if cfg.name == _LM:
            lm_keys = [f"heads.{_LM}.{n}" for n in _linear_names(cfg, 1, _LM)]
            lm_keys = [f"{k}.weight" for k in lm_keys] + (
                [f"{k}.bias" for k in lm_keys] if cfg.output_bias else []
            )
            source = tensors if layout == "full" else adapter or {}
            prefix = _LM + "." if layout == "full" else f"{_LM}.base_layer."
            for key in lm_keys:
                got = source.get(prefix + key.rsplit(".", 1)[-1])
                if got is not None:
                    state[key] = got
            continue
        own = {
            k.removeprefix(f"heads.{cfg.name}."): v
            for k, v in tensors.items()
            if k.startswith(f"heads.{cfg.name}.")
        }
        if not own:
            own = _read_file(_contained(root, f"{cfg.name}.safetensors"), "head weights")
        state.update(_head_state(cfg, own, root))
    manifest = {
        "format": FORMAT,
        "layout": layout,
        "heads": configs,
        "weights": None,
        "backbone": {"kind": FORMAT},
        "adapter": {"format": FORMAT} if adapter is not None else None,
    }
    base = _resolve_base(root) if layout == "lora" else (str(root) if layout == "full" else None)
    if layout == "lora":
        check_base_sizes(base)
    return TransformerHeadsCheckpoint(root, layout, manifest, state, base, adapter, lm_keys)


def _head_config(fields: Any, root: Path) -> HeadConfig:
    if not isinstance(fields, dict):
        raise CheckpointError(f"{str(root)!r}: a head config {short_repr(fields)} is not an object")
    data = dict(fields)
    if data.get("pred_for_sequence"):
        data.setdefault("pooling", "last")  # it read the last non-padding token
    try:
        cfg = HeadConfig.from_dict(data, unknown="warn")
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"{str(root)!r}: invalid transformer-heads head config: {str(e)[:300]}"
        ) from None
    if not plain_name(cfg.name) or cfg.name.startswith("."):
        raise CheckpointError(
            f"{str(root)!r}: head name {short_repr(cfg.name)} is invalid; a transformer-heads "
            f"head is read from <name>.safetensors inside the folder: a plain file name (no "
            f"'/', '\\', leading '.'; at most {MAX_NAME} bytes)"
        )
    if cfg.name == _LM and cfg.num_layers != 1:
        raise CheckpointError(
            f"{str(root)!r}: head 'lm_head' has num_layers={cfg.num_layers}; transformer-heads "
            "used only the first Linear of a head named lm_head, so it cannot be restored as saved"
        )
    return cfg


def _head_state(cfg: HeadConfig, tensors: dict[str, torch.Tensor], root: Path) -> dict:
    """``lins.<i>.weight`` / ``.bias`` of one head → ``heads.<name>.<its i-th Linear>.*``."""
    n = cfg.num_layers
    if not n <= len(tensors) <= 2 * n:  # before the names are listed: num_layers=10**6
        raise CheckpointError(
            f"{str(root)!r}: head {short_repr(cfg.name)} (num_layers={n}) needs {n} to {2 * n} "
            f"tensors, the checkpoint holds {len(tensors)}: they do not match"
        )
    expected = {f"lins.{i}.weight" for i in range(n)}
    expected |= {f"lins.{i}.bias" for i in range(n - 1)}
    if cfg.output_bias:
        expected.add(f"lins.{n - 1}.bias")
    if set(tensors) != expected:
        raise CheckpointError(
            f"{str(root)!r}: head {short_repr(cfg.name)} (num_layers={n}, output_bias="
            f"{cfg.output_bias}) needs tensors {short_repr(sorted(expected), 200)}, the "
            f"checkpoint holds {short_repr(sorted(tensors), 200)}"
        )
    names = _linear_names(cfg, n, cfg.name)
    out = {}
    for key, value in tensors.items():
        _, i, kind = key.split(".")
        out[f"heads.{cfg.name}.{names[int(i)]}.{kind}"] = value
    return out


def _linear_names(cfg: HeadConfig, n: int, name: str) -> list[str]:
    """The names of the head's Linear layers in order, asked of the head kind itself (built on
    the meta device at width 1: nothing is allocated)."""
    small = cfg.replace(
        in_size=1, num_outputs=1, hidden_size=1 if n > 1 else 0, dropout=0.0, trainable=False
    )
    with torch.device("meta"):
        head = HEADS.get(small.head_type)(small)
    names = [k for k, m in head.named_modules() if isinstance(m, nn.Linear)]
    if len(names) != n:
        raise CheckpointError(f"head {name!r}: {len(names)} Linear layers, the checkpoint has {n}")
    return names


def _is_head_key(key: str) -> bool:
    return key.startswith(("heads.", _LM + "."))


def _prefix_of(adapter: dict[str, torch.Tensor]) -> str:
    """The task model's name for the backbone in adapter keys ("model." for Llama, ...)."""
    prefixes = {k.split(".", 1)[0] for k in adapter if not _is_head_key(k)}
    return f"{prefixes.pop()}." if len(prefixes) == 1 else ""


def _read_adapter(root: Path) -> dict[str, torch.Tensor]:
    file = _contained(root, ADAPTER_WEIGHTS)
    if not file.is_file():
        _refuse_pickles(root, ADAPTER_WEIGHTS)
    state = _read_file(file, "adapter weights")
    return {k.removeprefix(PEFT_PREFIX): v for k, v in state.items()}


def _resolve_base(root: Path) -> str:
    """The adapter's ``base_model_name_or_path``: as written (a path from where it was saved,
    or a hub id), else a folder of that name beside the checkpoint or inside it."""
    config = _json(root / ADAPTER_CONFIG) or {}
    base = config.get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise CheckpointError(
            f"{str(root / ADAPTER_CONFIG)!r}: base_model_name_or_path={short_repr(base)} is "
            "invalid; the base model's path or hub id"
        )
    if os.path.isdir(base):
        return os.path.abspath(base)
    for near in (root.parent / base, root / base):
        if near.is_dir():
            return str(near.resolve())
    return base


def _model_type(base: str | None) -> str | None:
    config = _json(Path(base) / _CONFIG) if base and os.path.isdir(base) else None
    return config.get("model_type") if isinstance(config, dict) else None


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _read_weights(root: Path) -> dict[str, torch.Tensor]:
    """The full layout's tensors: ``model.safetensors`` or the shards its index names."""
    index = _json(root / _INDEX)
    if isinstance(index, dict) and isinstance(index.get("weight_map"), dict):
        files = sorted(set(index["weight_map"].values()))
        if not all(
            isinstance(f, str) and "/" not in f and f.endswith(".safetensors") for f in files
        ):
            raise CheckpointError(
                f"{str(root / _INDEX)!r} names files {short_repr(files[:3], 300)}; safetensors "
                "files inside the folder only"
            )
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(_read_file(_contained(root, f), "model weights"))
        return state
    if not _contained(root, _WEIGHTS).is_file():
        _refuse_pickles(root, _WEIGHTS)
    return _read_file(root / _WEIGHTS, "model weights")


def _refuse_pickles(root: Path, wanted: str) -> None:
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
    extra = f"; it holds pickle files {pickles}, which headkit never loads" if pickles else ""
    raise CheckpointError(f"{str(root)!r}: {wanted} is missing{extra}")


def _read_file(path: Path, what: str) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; CheckpointError when it is missing, unreadable, or holds
    a NaN or infinite value (named by its tensor)."""
    if not path.is_file():
        raise CheckpointError(f"{what} {str(path)!r} is missing")
    try:
        state = load_file(str(path))
    except Exception as e:  # safetensors raises plain Exception subclasses
        raise CheckpointError(f"{what} {str(path)!r} cannot be read: {e}") from None
    for key, value in state.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(
                f"{what} {str(path)!r}: tensor {short_repr(key)} holds NaN or infinite values"
            )
    return state


def _contained(root: Path, name: str) -> Path:
    """``root/name``, refused when it resolves (through a symlink) outside ``root``."""
    path = root / name
    check_inside(path, root, f"{name!r} of the transformer-heads checkpoint")
    return path


def _check_contained(root: Path, name: str, what: str) -> None:
    if os.path.lexists(root / name):
        check_inside(root / name, root, f"{what!r} of the transformer-heads checkpoint")


#: config.json keys that give a backbone's number of blocks, its width and its vocabulary.
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_WIDTH_KEYS = ("hidden_size", "n_embd", "d_model", "dim")
_VOCAB_KEYS = ("vocab_size",)


def check_config_sizes(root: Path, config: Any, tensors: dict[str, Any]) -> None:
    """Refuse a ``config.json`` whose sizes the weights cannot hold, before anything is built:
    every block holds at least one tensor, and the embedding table ``vocab_size x width``
    values (a ``n_layer=10**6`` config would otherwise build a million blocks). ``tensors``
    maps names to tensors, or to their numbers of values."""
    if not isinstance(config, dict):
        return
    where = f"{str(root / _CONFIG)!r}"
    layers = _size(config, _LAYER_KEYS)
    if layers is not None and not 0 < layers[1] <= len(tensors):
        raise CheckpointError(
            f"{where}: {layers[0]}={short_repr(layers[1])} blocks, but {_WEIGHTS} holds "
            f"{len(tensors)} tensors (each block needs at least one): they do not match; "
            "nothing was built"
        )
    width, vocab = _size(config, _WIDTH_KEYS), _size(config, _VOCAB_KEYS)
    have = sum(t if isinstance(t, int) else t.numel() for t in tensors.values())
    if width and vocab and width[1] * vocab[1] > 2 * have + (1 << 20):
        raise CheckpointError(
            f"{where}: {vocab[0]}={short_repr(vocab[1])} x {width[0]}={short_repr(width[1])} "
            f"needs {short_repr(width[1] * vocab[1])} values, but {_WEIGHTS} holds {have}: they "
            "do not match; nothing was built"
        )


def check_base_sizes(base: str | None) -> None:
    """``check_config_sizes`` for a LoRA save's base when it is a local folder of safetensors
    weights, from the files' headers alone (nothing is read of the weights)."""
    if not base or not os.path.isdir(base):
        return
    folder = Path(base)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return
    from safetensors import safe_open

    counts: dict[str, int] = {}
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    counts[key] = math.prod(f.get_slice(key).get_shape())
    except Exception:  # an unreadable file is reported when the base is loaded
        return
    check_config_sizes(folder, _json(folder / _CONFIG), counts)


def _size(config: dict[str, Any], keys: tuple[str, ...]) -> tuple[str, int] | None:
    """(key, value) of the first of ``keys`` the config gives as an integer."""
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return key, value
    return None
