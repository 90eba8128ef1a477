"""A backbone that lives in a folder another checkpoint owns is brought into the checkpoint
being saved, never referenced: that checkpoint's next save deletes the folder.

``load_headed("A/backbone-<token>", ...)`` (or a model restored from checkpoint A) saved
into B gets its own ``B/backbone-<token'>/``: its files hard-linked from A's folder where the
file system allows (no second copy of the bytes; each checkpoint's deletion removes only its
own name), copied otherwise, and checksummed in B's manifest like any saved backbone. A
backbone loaded in another dtype than its files hold, from a sub-folder, quantised, or whose
files changed on disk since it was loaded is written from memory instead.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..backbone.inspection import base_model_of
from ..backbone.sources import model_fingerprint
from ..errors import CheckpointError
from .adapters import quantization_entry
from .journal import MARKER, write_marker
from .manifest import fsync_dir, fsync_file, sha256_file
from .paths import owning_checkpoint

if TYPE_CHECKING:
    from .contract import CheckpointModel


def foreign_owner(model: CheckpointModel, root: Path, save_backbone: bool | None) -> Path | None:
    """The backbone folder the model was loaded from when another checkpoint than ``root``
    owns it (None otherwise); ``save_backbone=False`` there is a CheckpointError."""
    src = model.source
    local = src is not None and os.path.isabs(src.source)  # (a hub id is no folder here)
    found = owning_checkpoint(src.source) if local else None
    if found is None:
        return None
    owner, entry = found
    try:
        if root.exists() and os.path.samefile(owner, root):
            return None  # saving back into its own checkpoint: the manifest keeps the folder
    except OSError:
        pass
    if save_backbone is False:
        raise CheckpointError(
            f"save_backbone=False, but the backbone was loaded from {str(owner / entry)!r}, a "
            f"folder that checkpoint {str(owner)!r} owns and deletes on its next save; a "
            "reference to it would break then: pass save_backbone=None (hard-linked or copied "
            "into this checkpoint) or True"
        )
    return owner / entry


def link_backbone(
    model: CheckpointModel, folder: Path, root: Path, token: str
) -> dict[str, Any] | None:
    """``root/backbone-<token>/`` with the files of ``folder`` hard-linked (copied where links
    are refused), or None when the files are not what the model holds (write it instead)."""
    src = model.source
    if src.dtype is not None or src.kwargs or quantization_entry(model.backbone):
        return None
    entries = [e for e in sorted(folder.iterdir()) if e.name != MARKER]
    if any(e.is_symlink() or not e.is_file() for e in entries):
        return None
    if model_fingerprint(base_model_of(model.backbone), folder, {}) != src.fingerprint:
        return None  # changed on disk since it was loaded
    tmp = new_backbone_folder(root, token)
    for entry in entries:
        _link_or_copy(entry, tmp / entry.name)
    return commit_backbone_folder(tmp, root)


def new_backbone_folder(root: Path, token: str) -> Path:
    """The temporary folder of ``root/backbone-<token>/``, its marker written first: a
    folder without it is never deleted."""
    tmp = root / f".tmp-backbone-{token}"
    tmp.mkdir()
    write_marker(tmp, token)
    return tmp


def commit_backbone_folder(tmp: Path, root: Path) -> dict[str, Any]:
    """Rename a filled ``new_backbone_folder`` into place (durable); its manifest entry,
    with the checksum of each weight file."""
    name = tmp.name.removeprefix(".tmp-")
    checksums = {f.name: sha256_file(f) for f in sorted(tmp.glob("*.safetensors"))}
    fsync_dir(tmp)
    os.replace(tmp, root / name)
    return {"kind": "saved", "path": name, "files_sha256": checksums, "fingerprint": None}


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError:  # another file system, or one without hard links
        shutil.copyfile(source, target)
        fsync_file(target)
