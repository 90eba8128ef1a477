"""Reading and validating ``head_configs.json``, and the checkpoint's file helpers.

Every malformed manifest gives a ``CheckpointError`` naming the field, the value and what is
allowed. Unknown top-level fields and unknown head-config fields are ignored with a warning,
so a checkpoint written by a newer headkit that only added fields still loads.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from ..config import HeadConfig
from ..errors import CheckpointError, ConfigError
from ..source import RECORDED_KWARGS

MANIFEST = "head_configs.json"
FORMAT = "headkit"
FORMAT_VERSION = 1
#: Manifest field: head weights that are the backbone's input embeddings (not in the file).
TIED = "tied_to_input_embeddings"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def read_manifest(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """Read and validate ``head_configs.json``; raise CheckpointError on any problem.

    ``manifest["heads"]`` comes back as HeadConfig objects.
    """
    root = Path(checkpoint_dir)
    path = root / MANIFEST
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {str(root)!r} does not exist")
    if not path.is_file():
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
        extra = f"; it holds pickle files {pickles}, which headkit never loads" if pickles else ""
        raise CheckpointError(f"{str(path)!r} is missing: not a headkit checkpoint{extra}")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
        raise CheckpointError(f"{str(path)!r} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{str(path)!r} must hold a JSON object")
    _check_version(manifest, str(path))
    for key, typ in (("heads", list), ("weights", str), ("backbone", dict)):
        if not isinstance(manifest.get(key), typ):
            raise CheckpointError(
                f"{str(path)!r}: field {key!r}={manifest.get(key)!r} is missing or not a "
                f"{typ.__name__}"
            )
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{str(path)!r}: format={manifest.get('format')!r}, expected {FORMAT!r}"
        )
    weights = manifest["weights"]
    if "/" in weights or "\\" in weights or not weights.endswith(".safetensors"):
        raise CheckpointError(f"{str(path)!r}: weights={weights!r} must name a .safetensors file")
    _check_manifest_fields(manifest, str(path))
    try:
        manifest["heads"] = [HeadConfig.from_dict(h, unknown="warn") for h in manifest["heads"]]
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{str(path)!r}: invalid head config: {e}") from None
    return manifest


def _check_version(manifest: dict[str, Any], where: str) -> None:
    version = manifest.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise CheckpointError(
            f"{where!r} has format_version={version}, written by a newer headkit; this version "
            f"reads format_version <= {FORMAT_VERSION}: upgrade headkit"
        )
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointError(
            f"{where!r}: field 'format_version'={version!r} is missing or not a int"
        )


def _check_manifest_fields(manifest: dict[str, Any], where: str) -> None:
    """Validate the optional fields and the backbone entry (kinds, names, kwargs, dtype)."""

    def bad(field: str, value: Any, allowed: str) -> CheckpointError:
        return CheckpointError(f"{where}: {field}={value!r} is invalid; {allowed}")

    sha = manifest.get("weights_sha256")
    if sha is not None and not isinstance(sha, str):
        raise bad("weights_sha256", sha, "a hex string or absent")
    weighting = manifest.get("loss_weighting")
    if weighting is not None and (
        not isinstance(weighting, dict) or not isinstance(weighting.get("name", "fixed"), str)
    ):
        raise bad("loss_weighting", weighting, 'a dict like {"name": "fixed"}')
    if manifest.get("nonfinite_loss", "raise") not in ("raise", "skip"):
        raise bad("nonfinite_loss", manifest["nonfinite_loss"], "'raise' or 'skip'")
    tied = manifest.get(TIED, [])
    if not isinstance(tied, list) or not all(
        isinstance(t, str) and t.startswith("heads.") for t in tied
    ):
        raise bad(TIED, tied, "a list of head parameter names such as 'heads.lm_head.mlp.0.weight'")
    layers_path = manifest.get("layers_path")
    if layers_path is not None and not isinstance(layers_path, str):
        raise bad("layers_path", layers_path, "a module path such as 'model.layers' or absent")
    bb = manifest["backbone"]
    kind = bb.get("kind")
    if kind == "saved":
        sub = bb.get("path")
        if not isinstance(sub, str) or not sub.startswith("backbone-") or {"/", "\\"} & set(sub):
            raise bad("backbone.path", sub, "the name of a 'backbone-*' folder in the checkpoint")
        files = bb.get("files_sha256")
        if files is not None and (
            not isinstance(files, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
        ):
            raise bad("backbone.files_sha256", files, "a dict of file name → sha256 hex string")
    elif kind == "reference":
        if not isinstance(bb.get("source"), str) or not bb["source"]:
            raise bad("backbone.source", bb.get("source"), "a model path or hub id")
        kwargs = bb.get("kwargs") or {}
        # Only the recorded keywords: a checkpoint must not switch on e.g. trust_remote_code.
        if not isinstance(kwargs, dict) or any(
            k not in RECORDED_KWARGS or not isinstance(v, str) for k, v in kwargs.items()
        ):
            raise bad("backbone.kwargs", kwargs, f"string values for {list(RECORDED_KWARGS)}")
        dtype = bb.get("dtype")
        if dtype is not None and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise bad("backbone.dtype", dtype, "a torch dtype name such as 'float32' or null")
    else:
        raise bad("backbone.kind", kind, "'saved' or 'reference'")
