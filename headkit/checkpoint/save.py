"""Writing a checkpoint atomically: uniquely named files first, the manifest last.

The manifest is the commit point: new weight files get fresh names, the manifest is replaced
with ``os.replace`` (atomic on POSIX), and only then are the previous files deleted. A crash
at any moment leaves either the old or the new checkpoint complete and loadable.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors.torch import save_file

from ..errors import CheckpointError
from ..source import backbone_fingerprint
from ..tying import tied_head_weights
from .manifest import FORMAT, FORMAT_VERSION, MANIFEST, TIED, fsync_dir, fsync_file, sha256_file

if TYPE_CHECKING:
    from ..model import HeadedModel


def backbone_is_referable(model: HeadedModel) -> bool:
    """A frozen backbone, unchanged since it was loaded from a recorded source."""
    src = model.source
    if src is None or not src.fingerprint:
        return False
    if any(p.requires_grad for p in model.backbone.parameters()):
        return False
    return backbone_fingerprint(model.backbone) == src.fingerprint


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
    weights_name = _write_heads(model, root, token)
    referable = backbone_is_referable(model)
    if save_backbone is None:
        save_backbone = not referable
    if not save_backbone and model.source is None:
        raise CheckpointError(
            "save_backbone=False, but the backbone has no source to reference (it was built in "
            "memory); save it or load it with load_headed(path)"
        )
    if save_backbone:
        backbone_entry = _write_backbone(model, root, token)
    else:
        if not referable:
            warnings.warn(
                "save_backbone=False: the backbone was changed since loading; the checkpoint "
                "references the original, so predictions may differ after loading",
                stacklevel=3,
            )
        backbone_entry = {"kind": "reference", **model.source.to_manifest()}
        backbone_entry["fingerprint"] = model.source.fingerprint
    backbone_entry["class"] = type(model.backbone).__name__
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "heads": [c.to_dict() for c in model.head_configs.values()],
        "weights": weights_name,
        "weights_sha256": sha256_file(root / weights_name),
        "backbone": backbone_entry,
        "loss_weighting": model.loss_weighting.config(),
        "nonfinite_loss": model.nonfinite_loss,
    }
    if model.layers_path is not None:
        manifest["layers_path"] = model.layers_path
    tied = tied_head_weights(model.backbone, model.heads)
    if tied:  # shared with the backbone's input embeddings: re-tied on load, never written
        manifest[TIED] = tied
    _commit(root, manifest, token)
    keep = {MANIFEST, weights_name, backbone_entry.get("path")}
    for p in root.iterdir():
        stale = p.name.startswith(("heads-", "backbone-", ".tmp-")) and p.name not in keep
        if stale:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return root


def _write_heads(model: HeadedModel, root: Path, token: str) -> str:
    name = f"heads-{token}.safetensors"
    tmp = root / f".tmp-{name}"
    state = {k: v.detach().contiguous().cpu() for k, v in model.head_state_dict().items()}
    save_file(state, str(tmp), metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION)})
    os.chmod(tmp, 0o644)  # safetensors creates files readable by the owner only
    fsync_file(tmp)
    os.replace(tmp, root / name)
    return name


def _write_backbone(model: HeadedModel, root: Path, token: str) -> dict[str, Any]:
    name = f"backbone-{token}"
    tmp = root / f".tmp-{name}"
    model.backbone.save_pretrained(tmp, safe_serialization=True)
    checksums = {f.name: sha256_file(f) for f in sorted(tmp.glob("*.safetensors"))}
    os.replace(tmp, root / name)
    return {"kind": "saved", "path": name, "files_sha256": checksums, "fingerprint": None}


def _commit(root: Path, manifest: dict[str, Any], token: str) -> None:
    fsync_dir(root)  # the renamed weight files are durable before the commit point
    tmp = root / f".tmp-{MANIFEST}-{token}"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    fsync_file(tmp)
    os.replace(tmp, root / MANIFEST)  # <- the commit point
    fsync_dir(root)
