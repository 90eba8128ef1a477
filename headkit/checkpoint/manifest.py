"""Reading and validating ``head_configs.json``, and the checkpoint's file helpers.

Every malformed manifest gives a ``CheckpointError`` naming the field, the value and what is
allowed. Unknown top-level fields and unknown head-config fields are ignored with a warning,
so a checkpoint written by a newer headkit that only added fields still loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from ..backbone.safety import PICKLE_SUFFIXES
from ..backbone.sources import RECORDED_KWARGS
from ..config import HeadConfig
from ..errors import CheckpointError, ConfigError
from .paths import MANIFEST, MAX_NAME, plain_name

FORMAT = "headkit"
FORMAT_VERSION = 2  # the newest this version reads and writes: 2 adds a LoRA adapter
PLAIN_FORMAT_VERSION = 1  # checkpoints without an adapter, readable by earlier versions
#: Manifest field: head weights that are the backbone's input embeddings (not in the file).
TIED = "tied_to_input_embeddings"
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: The most heads one checkpoint may describe, and the largest manifest read (bytes):
#: refused before anything is built (a head config takes about 100 to 500 bytes).
MAX_HEADS = 10_000
MAX_MANIFEST_BYTES = 16 << 20


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


_TRAINER_FOLDER = (
    "{path!r} is missing: this folder holds a whole state dict that transformers.Trainer "
    "wrote from a HeadedModel (heads {heads}), without the head configs, so it does not load "
    "alone (headkit.HeadedTrainer's checkpoints do). Load it onto the model Trainer trained: "
    "load_headed(<its backbone>, head_configs=[<its HeadConfigs>], head_folder_path={folder!r}) "
    "checks its keys, shapes and values and calls load_state_dict; save_pretrained(...) then "
    "writes a checkpoint that loads alone"
)
#: Largest safetensors header read to tell a Trainer's state-dict file (bytes).
_MAX_HEADER = 64 << 20


def trainer_state_dict_heads(root: Path) -> list[str]:
    """The head names in a ``model.safetensors`` that ``transformers.Trainer`` wrote from a
    HeadedModel's whole state dict (keys ``heads.<name>.*`` next to ``backbone.*``); [] for
    any other folder. Reads the file's header only."""
    path = root / "model.safetensors"
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= _MAX_HEADER:
                return []
            keys = json.loads(f.read(n))
    except (OSError, ValueError, RecursionError):
        return []
    if not isinstance(keys, dict) or not any(str(k).startswith("backbone.") for k in keys):
        return []
    return sorted({str(k).split(".")[1] for k in keys if str(k).startswith("heads.")})


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
        heads = trainer_state_dict_heads(root)
        if heads:
            raise CheckpointError(
                _TRAINER_FOLDER.format(path=str(path), heads=heads, folder=str(root))
            )
        raise CheckpointError(f"{str(path)!r} is missing: not a headkit checkpoint{extra}")
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise CheckpointError(
            f"{str(path)!r} is {size} bytes; a manifest is at most {MAX_MANIFEST_BYTES} bytes "
            f"(MAX_MANIFEST_BYTES, room for {MAX_HEADS} heads): not read"
        )
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
        raise CheckpointError(f"{str(path)!r} is not valid JSON ({e})") from None
    except OSError as e:
        raise CheckpointError(f"{str(path)!r} cannot be read: {e}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{str(path)!r} must hold a JSON object")
    _check_version(manifest, str(path))
    for key, typ in (("heads", list), ("weights", str), ("backbone", dict)):
        if not isinstance(manifest.get(key), typ):
            raise CheckpointError(
                f"{str(path)!r}: field {key!r}={_short(manifest.get(key))} is missing or not a "
                f"{typ.__name__}"
            )
    check_head_count(len(manifest["heads"]), str(path))
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{str(path)!r}: format={_short(manifest.get('format'))}, expected {FORMAT!r}"
        )
    weights = manifest["weights"]
    if not plain_name(weights) or not weights.endswith(".safetensors"):
        raise CheckpointError(
            f"{str(path)!r}: weights={_short(weights)} must name a .safetensors file in the "
            f"checkpoint folder (a plain name of at most {MAX_NAME} bytes)"
        )
    _check_manifest_fields(manifest, str(path))
    try:
        manifest["heads"] = [HeadConfig.from_dict(h, unknown="warn") for h in manifest["heads"]]
    except (ConfigError, TypeError, ValueError) as e:
        message = str(e) if len(str(e)) <= 500 else str(e)[:497] + "..."
        raise CheckpointError(f"{str(path)!r}: invalid head config: {message}") from None
    return manifest


def check_head_count(count: int, where: str) -> None:
    """Refuse a checkpoint of more than MAX_HEADS heads before any is read or built."""
    if count > MAX_HEADS:
        raise CheckpointError(
            f"{where!r} describes {count} heads; a checkpoint holds at most {MAX_HEADS} "
            "(MAX_HEADS): not built"
        )


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (manifests can hold huge values): what an
    error message echoes of a value read from a file."""
    try:
        text = repr(value)
    except ValueError:  # an integer beyond sys.get_int_max_str_digits()
        text = f"<int of about {int(value.bit_length() * 0.30103)} digits>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


_short = short_repr


def _check_version(manifest: dict[str, Any], where: str) -> None:
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointError(
            f"{where!r}: field 'format_version'={_short(version)} is missing or not a int"
        )
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{where!r} has format_version={_short(version)}, written by a newer headkit; this "
            f"version reads format_version <= {FORMAT_VERSION}: upgrade headkit"
        )
    if version < 1:
        raise CheckpointError(
            f"{where!r}: format_version={version} is invalid; headkit writes positive versions "
            f"(this one reads 1..{FORMAT_VERSION})"
        )


def _check_manifest_fields(manifest: dict[str, Any], where: str) -> None:
    """Validate the optional fields and the backbone entry (kinds, names, kwargs, dtype)."""

    def bad(field: str, value: Any, allowed: str) -> CheckpointError:
        return CheckpointError(f"{where}: {field}={_short(value)} is invalid; {allowed}")

    sha = manifest.get("weights_sha256")
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise bad(
            "weights_sha256",
            sha,
            "the sha256 of the weights file (64 lowercase hex digits); a checkpoint without "
            "it cannot be verified and is refused",
        )
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
        if not plain_name(sub) or not sub.startswith("backbone-"):
            raise bad("backbone.path", sub, "the name of a 'backbone-*' folder in the checkpoint")
        files = bb.get("files_sha256")
        if (
            not isinstance(files, dict)
            or not files
            or not all(plain_name(k) and _SHA256.fullmatch(str(v)) for k, v in files.items())
        ):
            raise bad(
                "backbone.files_sha256",
                files,
                "a dict of file name → sha256 (64 hex digits) for every safetensors file of "
                "the saved backbone",
            )
    elif kind == "reference":
        if not _valid_source(bb.get("source")):
            raise bad(
                "backbone.source",
                bb.get("source"),
                'a model path or hub id, {"package": name, "path": path inside it} or '
                '{"checkpoint": path relative to the checkpoint}',
            )
        kwargs = bb.get("kwargs") or {}
        # Only the recorded keywords: a checkpoint must not switch on e.g. trust_remote_code.
        if not isinstance(kwargs, dict) or any(
            k not in RECORDED_KWARGS or not isinstance(v, str) for k, v in kwargs.items()
        ):
            raise bad("backbone.kwargs", kwargs, f"string values for {list(RECORDED_KWARGS)}")
        for key in ("subfolder", "gguf_file"):  # joined to the backbone's folder
            if key in kwargs and not _inside_path(kwargs[key]):
                raise bad(
                    f"backbone.kwargs.{key}",
                    kwargs[key],
                    "a relative path inside the backbone's folder (no '..', not absolute)",
                )
        dtype = bb.get("dtype")
        if dtype not in (None, "auto") and not (
            isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype)
        ):
            raise bad("backbone.dtype", dtype, "a torch dtype name such as 'float32' or null")
    else:
        raise bad("backbone.kind", kind, "'saved' or 'reference'")


def _inside_path(value: str) -> bool:
    """A relative POSIX path that stays inside the folder it is joined to."""
    parts = value.split("/")
    return bool(value) and not {"\\", "\0"} & set(value) and value[0] != "/" and ".." not in parts


def _valid_source(source: Any) -> bool:
    if isinstance(source, str):
        return bool(source) and "\0" not in source
    if not isinstance(source, dict):
        return False
    if set(source) == {"package", "path"}:
        return all(isinstance(v, str) and v and "\0" not in v for v in source.values())
    rel = source.get("checkpoint")
    return set(source) == {"checkpoint"} and isinstance(rel, str) and bool(rel) and "\0" not in rel
