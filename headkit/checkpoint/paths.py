"""Names and places in a checkpoint: plain file names, containment, hub repo ids.

Every file a manifest names is a plain name inside the checkpoint folder, and must resolve
there: a ``backbone-*`` folder or weights file that is a symlink leading elsewhere is refused.
A checkpoint in a Hugging Face cache snapshot (``models--org--name/snapshots/<commit>``)
holds symlinks into that repo's ``blobs`` folder: its containment root is the repo folder.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

MANIFEST = "head_configs.json"
#: Longest file name most file systems accept (bytes).
MAX_NAME = 255
#: ``org/name`` or ``name``, as the hub spells repo ids.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")
#: Keywords of ``HeadedModel.from_pretrained`` that choose a checkpoint on the hub.
HUB_KWARGS = ("revision", "cache_dir", "local_files_only", "token")
#: The exact names of what a save writes and a later save may replace: the heads file, a
#: backbone copy, a LoRA adapter; each with the writing save's 12-hex-digit token.
OWNED = re.compile(
    r"heads-(?P<file>[0-9a-f]{12})\.safetensors|(backbone|adapter)-(?P<dir>[0-9a-f]{12})"
)


def plain_name(name: Any) -> bool:
    """A non-empty file name without directories, of at most MAX_NAME bytes."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not {"/", "\\", "\0"} & set(name)
        and len(name.encode("utf-8", "surrogatepass")) <= MAX_NAME
    )


def token_of(name: str) -> str | None:
    """The save token in a name of headkit's exact form (``OWNED``), else None."""
    m = OWNED.fullmatch(name)
    return (m.group("file") or m.group("dir")) if m else None


def owning_checkpoint(path: str | os.PathLike) -> tuple[Path, str] | None:
    """(checkpoint folder, entry) when ``path`` resolves into a ``backbone-*`` or ``adapter-*``
    folder of a headkit checkpoint: a folder that checkpoint's next save may delete."""
    try:
        real = Path(path).resolve()
    except (OSError, RuntimeError):
        return None
    for parent in real.parents:
        first = real.relative_to(parent).parts[0]
        if OWNED.fullmatch(first) and not first.startswith("heads-") and is_checkpoint(parent):
            return parent, first
    return None


def containment_root(root: Path) -> Path:
    """The folder everything in the checkpoint must resolve into (see the module docstring)."""
    real = root.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def check_inside(path: Path, root: Path, what: str) -> None:
    """Refuse ``path`` if it resolves (through symlinks) outside the checkpoint ``root``."""
    try:
        real = path.resolve()
    except (OSError, RuntimeError) as e:
        raise CheckpointError(f"{what} {str(path)!r} cannot be resolved: {e}") from None
    if not real.is_relative_to(containment_root(root)):
        raise CheckpointError(
            f"{what} {str(path)!r} leads outside the checkpoint (to {str(real)!r}); a "
            "checkpoint's files must be inside its folder"
        )


def check_tree_inside(folder: Path, root: Path, what: str) -> None:
    """``check_inside`` for a folder and every entry in it."""
    check_inside(folder, root, what)
    for entry in folder.iterdir():
        check_inside(entry, root, f"{what} entry")


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a local folder holding a headkit manifest."""
    try:
        return Path(path, MANIFEST).is_file()
    except (OSError, ValueError):
        return False


def resolve_checkpoint(checkpoint: str | os.PathLike, hub: dict[str, Any]) -> Path:
    """A local checkpoint folder, or the local snapshot of a hub repo id holding one.

    For a repo id, only the manifest and the files it names are fetched
    (``huggingface_hub.snapshot_download``; offline, from the local cache, when
    ``HF_HUB_OFFLINE=1`` or ``local_files_only=True``). ``hub``: HUB_KWARGS given.
    """
    path = Path(checkpoint)
    if path.exists() or not isinstance(checkpoint, str) or not _REPO_ID.fullmatch(checkpoint):
        return path
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return path

    def fetch(patterns: list[str]) -> Path:
        try:
            return Path(snapshot_download(checkpoint, allow_patterns=patterns, **hub))
        except (OSError, ValueError, HFValidationError) as e:
            raise CheckpointError(
                f"checkpoint directory {checkpoint!r} does not exist, and as a hub repo id it "
                f"cannot be resolved: {type(e).__name__}: {e}"
            ) from None

    folder = fetch([MANIFEST])
    if not (folder / MANIFEST).is_file():
        raise CheckpointError(
            f"hub repo {checkpoint!r} holds no {MANIFEST}: not a headkit checkpoint"
        )
    names = _named_by(folder / MANIFEST)
    return fetch([MANIFEST, *names]) if names else folder


def owned_files(manifest: Any) -> set[str]:
    """Names of the files and folders a (raw, possibly invalid) manifest says its save wrote:
    the heads' weights file and a saved backbone folder. Only these are ever deleted."""
    if not isinstance(manifest, dict):
        return set()
    names = {manifest.get("weights")}
    bb = manifest.get("backbone")
    if isinstance(bb, dict) and bb.get("kind") == "saved":
        names.add(bb.get("path"))
    adapter = manifest.get("adapter")
    if isinstance(adapter, dict):
        names.add(adapter.get("path"))
    return {n for n in names if plain_name(n)}


def referenced_files(manifest: Any) -> set[str]:
    """Entries of the checkpoint folder a manifest uses without owning them: a referenced
    backbone inside the checkpoint (e.g. a ``backbone-*`` folder it was loaded from)."""
    bb = manifest.get("backbone") if isinstance(manifest, dict) else None
    source = bb.get("source") if isinstance(bb, dict) else None
    rel = source.get("checkpoint") if isinstance(source, dict) else None
    if not isinstance(rel, str) or not rel:
        return set()
    first = rel.replace("\\", "/").split("/")[0]
    return {first} if plain_name(first) else set()


def read_raw(manifest: Path) -> Any:
    """The JSON a manifest holds, or None when it is missing or unreadable."""
    try:
        return json.loads(manifest.read_text())
    except (OSError, ValueError, RecursionError):
        return None


def _named_by(manifest: Path) -> list[str]:
    """Download patterns for the files a (not yet validated) manifest names."""
    names = owned_files(read_raw(manifest))
    return [f"{n}/*" if not n.endswith(".safetensors") else n for n in sorted(names)]
