"""Checkpoints: ``head_configs.json`` + safetensors, written atomically, read without pickle.

Layout of a checkpoint directory::

    head_configs.json              the manifest (format version, head configs, file names)
    heads-<token>.safetensors      head and loss-weighting tensors
    backbone-<token>/              the backbone (config.json + *.safetensors), only when it
                                   was trained, modified, or has no loadable source

The manifest is the commit point: new weight files get fresh names, the manifest is replaced
with ``os.replace`` (atomic on POSIX), and only then are the previous files deleted. A crash
at any moment leaves either the old or the new checkpoint complete and loadable.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import HeadConfig
from .errors import CheckpointError, ConfigError
from .loading import _RECORDED_KWARGS

if TYPE_CHECKING:
    from .model import HeadedModel

MANIFEST = "head_configs.json"
FORMAT = "headkit"
FORMAT_VERSION = 1
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


# ---------------------------------------------------------------------- helpers
def backbone_fingerprint(model: torch.nn.Module) -> str:
    """A cheap digest of every backbone tensor (names, shapes, dtypes, sums)."""
    h = hashlib.sha256()
    items = list(model.state_dict().items())
    with torch.no_grad():
        # float64 accumulation without float64 copies of the (possibly huge) tensors
        sums = [t.detach().sum(dtype=torch.float64) for _, t in items]
        abs_sums = [t.detach().abs().sum(dtype=torch.float64) for _, t in items]
        values = torch.stack(sums + abs_sums).cpu().tolist() if items else []
    for (name, t), v in zip(items, values):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{v!r};".encode())
    for v in values[len(items) :]:
        h.update(f"{v!r};".encode())
    return h.hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
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


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _backbone_is_referable(model: HeadedModel) -> bool:
    src = model.backbone_source
    if not src or not model.backbone_fingerprint:
        return False
    if any(p.requires_grad for p in model.backbone.parameters()):
        return False
    return backbone_fingerprint(model.backbone) == model.backbone_fingerprint


# ---------------------------------------------------------------------- save
def save_checkpoint(
    model: HeadedModel, save_directory: str | os.PathLike, *, save_backbone: bool | None = None
) -> Path:
    """Write ``model`` to ``save_directory`` atomically (see module docstring).

    ``save_backbone=None`` copies the backbone only when it cannot be referenced (trained,
    changed since loading, or built in memory); True/False force it.
    """
    root = Path(save_directory)
    root.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex[:12]
    weights_name = f"heads-{token}.safetensors"
    tmp = root / f".tmp-{weights_name}"
    state = {k: v.detach().contiguous().cpu() for k, v in model.head_state_dict().items()}
    save_file(state, str(tmp), metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION)})
    os.chmod(tmp, 0o644)  # safetensors creates files readable by the owner only
    _fsync_file(tmp)
    os.replace(tmp, root / weights_name)

    referable = _backbone_is_referable(model)
    if save_backbone is None:
        save_backbone = not referable
    if not save_backbone and not model.backbone_source:
        raise CheckpointError(
            "save_backbone=False, but the backbone has no source to reference (it was built in "
            "memory); save it or load it with load_headed(path)"
        )
    backbone_entry: dict[str, Any]
    if save_backbone:
        bb_name = f"backbone-{token}"
        bb_tmp = root / f".tmp-{bb_name}"
        model.backbone.save_pretrained(bb_tmp, safe_serialization=True)
        os.replace(bb_tmp, root / bb_name)
        backbone_entry = {"kind": "saved", "path": bb_name}
    else:
        if not referable:
            warnings.warn(
                "save_backbone=False: the backbone was changed since loading; the checkpoint "
                "references the original, so predictions may differ after loading",
                stacklevel=2,
            )
        backbone_entry = {"kind": "reference", **(model.backbone_source or {})}
    backbone_entry["fingerprint"] = model.backbone_fingerprint if not save_backbone else None
    backbone_entry["class"] = type(model.backbone).__name__

    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "heads": [c.to_dict() for c in model.head_configs.values()],
        "weights": weights_name,
        "weights_sha256": _sha256(root / weights_name),
        "backbone": backbone_entry,
        "loss_weighting": model.loss_weighting.config(),
        "nonfinite_loss": model.nonfinite_loss,
    }
    _fsync_dir(root)  # the renamed weight files are durable before the commit point
    mtmp = root / f".tmp-{MANIFEST}-{token}"
    mtmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    _fsync_file(mtmp)
    os.replace(mtmp, root / MANIFEST)  # <- the commit point
    _fsync_dir(root)

    keep = {MANIFEST, weights_name, backbone_entry.get("path")}
    for p in root.iterdir():
        stale = p.name.startswith(("heads-", "backbone-", ".tmp-")) and p.name not in keep
        if stale:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return root


# ---------------------------------------------------------------------- load
def read_manifest(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """Read and validate ``head_configs.json``; raise CheckpointError on any problem."""
    root = Path(checkpoint_dir)
    path = root / MANIFEST
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {str(root)!r} does not exist")
    if not path.is_file():
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        extra = f"; it holds pickle files {pickles}, which headkit never loads" if pickles else ""
        raise CheckpointError(f"{str(path)!r} is missing: not a headkit checkpoint{extra}")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{str(path)!r} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{str(path)!r} must hold a JSON object")
    if isinstance(manifest.get("format_version"), bool):
        manifest["format_version"] = str(manifest["format_version"])  # rejected just below
    if (
        isinstance(manifest.get("format_version"), int)
        and manifest["format_version"] > FORMAT_VERSION
    ):
        raise CheckpointError(
            f"{str(path)!r} has format_version={manifest['format_version']}, written by a newer "
            f"headkit; this version reads format_version <= {FORMAT_VERSION}: upgrade headkit"
        )
    for key, typ in (
        ("format_version", int),
        ("heads", list),
        ("weights", str),
        ("backbone", dict),
    ):
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
        manifest["heads"] = [HeadConfig.from_dict(h) for h in manifest["heads"]]
    except ConfigError as e:
        raise CheckpointError(f"{str(path)!r}: invalid head config: {e}") from None
    except TypeError as e:
        raise CheckpointError(f"{str(path)!r}: invalid head config: {e}") from None
    return manifest


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
    bb = manifest["backbone"]
    kind = bb.get("kind")
    if kind == "saved":
        sub = bb.get("path")
        if not isinstance(sub, str) or not sub.startswith("backbone-") or {"/", "\\"} & set(sub):
            raise bad("backbone.path", sub, "the name of a 'backbone-*' folder in the checkpoint")
    elif kind == "reference":
        if not isinstance(bb.get("source"), str) or not bb["source"]:
            raise bad("backbone.source", bb.get("source"), "a model path or hub id")
        kwargs = bb.get("kwargs") or {}
        # Only the recorded keywords: a checkpoint must not switch on e.g. trust_remote_code.
        if not isinstance(kwargs, dict) or any(
            k not in _RECORDED_KWARGS or not isinstance(v, str) for k, v in kwargs.items()
        ):
            raise bad("backbone.kwargs", kwargs, f"string values for {list(_RECORDED_KWARGS)}")
        dtype = bb.get("dtype")
        if dtype is not None and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise bad("backbone.dtype", dtype, "a torch dtype name such as 'float32' or null")
    else:
        raise bad("backbone.kind", kind, "'saved' or 'reference'")


def _min_head_numel(cfg: HeadConfig) -> int:
    """A lower bound on a head's parameter count from its config alone (no allocation)."""
    n_in, n_out, n = cfg.in_size or 1, cfg.num_outputs or 1, cfg.num_layers
    hidden = cfg.hidden_size
    return n_in * n_out if n == 1 else n_in * hidden + (n - 2) * hidden * hidden + hidden * n_out


def read_head_weights(checkpoint_dir: str | os.PathLike, manifest: dict) -> dict[str, torch.Tensor]:
    """Load the heads' safetensors file named by the manifest, checking its checksum."""
    path = Path(checkpoint_dir) / manifest["weights"]
    if not path.is_file():
        raise CheckpointError(f"weights file {str(path)!r} named in {MANIFEST} is missing")
    expected = manifest.get("weights_sha256")
    if expected and _sha256(path) != expected:
        raise CheckpointError(
            f"weights file {str(path)!r} is corrupt or truncated (sha256 differs from {MANIFEST})"
        )
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"weights file {str(path)!r} cannot be read: {e}") from None
    except Exception as e:  # safetensors raises plain Exception subclasses on some errors
        raise CheckpointError(f"weights file {str(path)!r} cannot be read: {e}") from None
    # Sizes come from the manifest: refuse ones far beyond what the file holds before anything
    # is built from them (a corrupt num_layers or num_outputs must not allocate gigabytes or
    # hang); small mismatches are reported tensor by tensor by load_head_weights.
    have = sum(t.numel() for t in state.values())
    need = sum(_min_head_numel(c) for c in manifest["heads"] if isinstance(c, HeadConfig))
    if need > 2 * have + (1 << 20):
        raise CheckpointError(
            f"{MANIFEST} in {str(checkpoint_dir)!r} describes heads with at least {need} "
            f"parameters, but {manifest['weights']!r} holds {have} values: they do not match"
        )
    return state


def load_head_weights(model: HeadedModel, state: dict[str, torch.Tensor], where: str) -> None:
    """Copy ``state`` into the model's heads, raising CheckpointError on any mismatch."""
    own = model.head_state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: head weights do not match {MANIFEST}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise CheckpointError(
                f"{where}: tensor {k!r} has shape {tuple(v.shape)}, but {MANIFEST} describes "
                f"{tuple(own[k].shape)}"
            )
        if own[k].is_floating_point() and not v.is_floating_point():
            raise CheckpointError(
                f"{where}: tensor {k!r} has dtype {v.dtype}; a floating-point dtype is expected"
            )
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise CheckpointError(f"{where}: tensor {k!r} holds NaN or infinite values")
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v.to(own[k].device, own[k].dtype))


def load_checkpoint(
    checkpoint_dir: str | os.PathLike,
    *,
    freeze_base_model: bool = True,
    only_inference: bool = False,
    torch_dtype: Any = None,
    device_map: Any = None,
    **from_pretrained_kwargs: Any,
) -> HeadedModel:
    """Rebuild a HeadedModel from a checkpoint: backbone, heads, loss weighting."""
    from .loading import load_backbone
    from .model import HeadedModel

    root = Path(checkpoint_dir)
    manifest = read_manifest(root)
    state = read_head_weights(root, manifest)  # before the backbone: corrupt files fail fast
    bb = manifest["backbone"]
    kwargs = dict(from_pretrained_kwargs)
    if bb.get("kind") == "saved":
        sub = bb.get("path")
        if not isinstance(sub, str) or "/" in sub or not (root / sub).is_dir():
            raise CheckpointError(f"backbone folder {sub!r} named in {MANIFEST} is missing")
        if not any((root / sub).glob("*.safetensors")):
            raise CheckpointError(f"backbone folder {str(root / sub)!r} has no safetensors file")
        source, kwargs["use_safetensors"] = str(root / sub), True
    elif bb.get("kind") == "reference":
        source = bb.get("source")
        for k, v in (bb.get("kwargs") or {}).items():
            kwargs.setdefault(k, v)
    else:
        raise CheckpointError(f"{MANIFEST}: backbone kind {bb.get('kind')!r} is unknown")
    if torch_dtype is None and bb.get("kind") == "reference" and bb.get("dtype"):
        torch_dtype = bb["dtype"]
    hf = load_backbone(source, torch_dtype=torch_dtype, device_map=device_map, **kwargs)
    weighting = manifest.get("loss_weighting") or {"name": "fixed"}
    model = HeadedModel(
        hf,
        manifest["heads"],
        freeze_base_model=freeze_base_model,
        nonfinite_loss=manifest.get("nonfinite_loss", "raise"),
    )
    w_kwargs = {k: v for k, v in weighting.items() if k != "name"}
    try:
        model.set_loss_weighting(weighting.get("name", "fixed"), **w_kwargs)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(
            f"{str(root / MANIFEST)!r}: loss_weighting={weighting!r} is invalid: {e}"
        ) from None
    load_head_weights(model, state, str(root))
    if bb.get("kind") == "reference":
        model.backbone_source = {k: bb[k] for k in ("source", "kwargs", "dtype") if k in bb}
        model.backbone_fingerprint = backbone_fingerprint(model.backbone)
        if bb.get("fingerprint") and bb["fingerprint"] != model.backbone_fingerprint:
            warnings.warn(
                f"the backbone loaded from {source!r} differs from the one these heads were "
                "saved with (different weights or dtype); predictions may differ",
                stacklevel=2,
            )
    if only_inference:
        model.eval().requires_grad_(False)
    return model
