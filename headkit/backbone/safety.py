"""Where a backbone may be read from, checked before transformers reads anything.

- a model given as a path (``./models/x``, ``/abs/x``) is a folder that exists, named as a
  missing folder rather than read as an invalid hub repo id (``check_local``);
- a checkpoint's backbone has safetensors (or GGUF) weights, never a pickle: a local folder
  of ``pytorch_model.bin`` only, or whose config names a pickle as ``transformers_weights``,
  is refused unread (``refuse_pickles``, what ``use_safetensors=True`` asks for);
- a recorded reference stays inside its root: ``{"checkpoint": path}`` inside the folder that
  holds the checkpoint, ``{"package": name, "path": path}`` inside the package
  (``inside_tree``, ``inside_package``);
- a transformers model class given with a checkpoint is of the checkpoint's family
  (``check_model_class``).
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import CheckpointError, ConfigError

#: Weight files that are pickles: never read from a checkpoint (safetensors and GGUF are).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def check_local(source: str | os.PathLike) -> None:
    """A model given as a path (absolute, ``./...``, ``../...``, ``~``) must be a folder that
    exists: say so, rather than let it be read as an invalid hub repo id."""
    name = os.fspath(source)
    if os.path.exists(name) or not isinstance(name, str):
        return
    if (
        os.path.isabs(name)
        or name.startswith(("./", "../", "~", ".\\", "..\\"))
        or name in (".", "..")
        or "\\" in name
        or name.count("/") > 1
    ):
        expanded = os.path.expanduser(name)
        if expanded != name and os.path.exists(expanded):
            raise CheckpointError(f"model folder {name!r}: '~' is not expanded; pass {expanded!r}")
        raise CheckpointError(
            f"model folder {name!r} does not exist (no such folder: "
            f"{os.path.abspath(expanded)!r}); give the folder a model was saved to "
            "(save_pretrained), or a hub id such as 'org/name'"
        )


def refuse_pickles(source: str | os.PathLike, kwargs: dict[str, Any]) -> None:
    """Refuse a local model whose weights transformers would read from a pickle (``*.bin``,
    ``*.pt``, ...), before it reads anything: what ``use_safetensors=True`` promises a
    checkpoint. GGUF files (``gguf_file``) are not pickles; a hub id is left to transformers,
    which ``use_safetensors=True`` makes refuse pickles."""
    path = Path(source)
    if kwargs.get("gguf_file") or not path.exists():
        return
    folder = path / kwargs["subfolder"] if kwargs.get("subfolder") else path
    if not folder.is_dir():
        raise CheckpointError(
            f"the backbone at {str(folder)!r} is not a folder; a checkpoint's backbone is a "
            "model folder with safetensors weights"
        )
    named = _json_object(folder / "config.json").get("transformers_weights")
    safe = (".safetensors", ".safetensors.index.json")
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if named is not None and not str(named).endswith(safe):
        pickles = [str(named)]
    elif any(folder.glob("*.safetensors")):
        return
    raise CheckpointError(
        f"the backbone folder {str(folder)!r} holds no safetensors weights"
        + (f", only pickle files {pickles}" if pickles else "")
        + "; headkit never reads weights from a pickle for a checkpoint: load the model "
        "yourself (you trust it) and save_pretrained it again, which writes safetensors"
    )


def _json_object(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def inside_package(dist: metadata.Distribution, source: dict[str, str]) -> Path:
    """The folder a ``{"package", "path"}`` source names, refused unless it lies inside one
    of the distribution's own top-level folders (``torch/../..`` leaves the package)."""
    rel = source["path"]
    parts = PurePosixPath(rel).parts
    base = Path(str(dist.locate_file(""))).resolve()
    tops = {PurePosixPath(str(f)).parts[0] for f in dist.files or () if str(f)} - {"..", "/"}
    path = Path(str(dist.locate_file(rel))).resolve()
    if os.path.isabs(rel) or not parts or parts[0] not in tops:
        inside = False
    else:
        inside = path.is_relative_to((base / parts[0]).resolve())
    if not inside:
        raise CheckpointError(
            f"the backbone recorded as {source!r} resolves to {str(path)!r}, outside the "
            f"package's own folders ({sorted(tops)[:5]}); a package reference stays inside "
            "its package"
        )
    return path


def inside_tree(checkpoint_root: Path, source: dict[str, str]) -> Path:
    """The folder a ``{"checkpoint": relative path}`` source names, refused unless it lies
    (through symlinks) inside the checkpoint's folder or the folder that holds it: the tree
    ``portable_source`` records such paths for."""
    root = checkpoint_root.resolve()
    tree = root.parent if root.parent != root.parent.parent else root
    path = (root / source["checkpoint"]).resolve()
    if not path.is_relative_to(tree):
        raise CheckpointError(
            f"the backbone recorded as {source!r} resolves to {str(path)!r}, outside "
            f"{str(tree)!r}; a checkpoint reference stays inside the checkpoint's folder or "
            "the folder that holds it"
        )
    return path


def check_model_class(
    cls: Any, model_type: str | None, where: Any, backbone_class: str | None = None
) -> None:
    """Refuse what is not a transformers model class, and a class of another family than the
    checkpoint's backbone (``GPT2Model`` for a Llama checkpoint: a ConfigError naming both
    classes); Auto classes and unknown types pass."""
    from transformers import PreTrainedModel

    from .._transformers import is_auto_class

    theirs = backbone_class or (f"a {model_type} model" if model_type else "its backbone")
    auto = is_auto_class(cls)
    if not isinstance(cls, type) or not (issubclass(cls, PreTrainedModel) or auto):
        raise ConfigError(
            f"model class {getattr(cls, '__name__', cls)} is not a transformers model class; "
            f"{str(where)!r} holds {theirs}: pass its class (or an Auto class), or the "
            "checkpoint path alone"
        )
    own = getattr(getattr(cls, "config_class", None), "model_type", None)
    if own and model_type and own != model_type:
        raise ConfigError(
            f"model class {cls.__name__} (model_type={own!r}) does not match the backbone of "
            f"{str(where)!r}, {theirs} (model_type={model_type!r}); pass a {model_type} class, "
            "or the checkpoint path alone"
        )
