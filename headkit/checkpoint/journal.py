"""What a save may delete: only what headkit provably wrote, recorded before it is written.

A name is deleted only when it has headkit's exact form *and* carries the token it was
written with:

- the heads file ``heads-<token>.safetensors`` holds the token in its safetensors metadata;
- a ``backbone-<token>/`` or ``adapter-<token>/`` folder (and its ``.tmp-`` folder while it
  is written) holds a ``.headkit-token`` marker with the token, written before anything else;
- a file or folder written before tokens existed is proven by the checksums the manifest
  it is replaced under records (``weights_sha256``, ``files_sha256``), and then only when
  the folder holds nothing but what a save writes;
- a temporary file ``.tmp-<final name>-<token>`` is proven by the record of the save with
  that token (below): its name is derived from the token, never read from the record.

Before a save writes anything it records, in ``.headkit-save-<token>.json``, its token and
the names it replaces (those of headkit's form the previous manifest says a save wrote).
After the commit it removes those that are proven as above and its own temporaries (never a
name the new manifest uses), then the record. A save that fails removes what it created. A
record left by a save that was killed is finished by the next save into the folder (under
the folder lock, so that save is dead), or by the next load of a writable folder while no save
holds the lock (``finish_killed_saves``). A record that is not in headkit's form (hand-written,
a folder, of another token) is reported with a warning and left alone; it never blocks a
save. Nothing else in the folder is touched: ``data-0123456789ab.csv``, ``backbone-user/``,
``heads-notes.md`` stay, whatever a manifest or a record names.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

from .lock import folder_lock
from .manifest import fsync_dir, sha256_file
from .paths import (
    MANIFEST,
    containment_root,
    owned_files,
    read_raw,
    referenced_files,
    token_of,
)

PREFIX = ".headkit-save-"
#: The file inside each folder a save writes, holding the save's token.
MARKER = ".headkit-token"
_RECORD = re.compile(r"\.headkit-save-([0-9a-f]{12})\.json")
#: Files a saved backbone folder holds besides its checksummed safetensors files.
_BACKBONE_FILES = {"config.json", "generation_config.json", "model.safetensors.index.json"}
#: The largest safetensors header read to find a file's token (bytes).
_MAX_HEADER = 1 << 24


def created_names(token: str) -> list[str]:
    """Every name a save with ``token`` may create: final names, then their temporaries."""
    final = [f"heads-{token}.safetensors", f"backbone-{token}", f"adapter-{token}"]
    temporary = [f".tmp-{n}" for n in final]
    return final + temporary + [f".tmp-{MANIFEST}-{token}", f".tmp-README.md-{token}"]


def in_use(manifest: Any) -> set[str]:
    """Every folder entry a (raw) manifest needs: never removed while it is in place."""
    return {MANIFEST} | owned_files(manifest) | referenced_files(manifest)


def write_marker(folder: Path, token: str) -> None:
    """Mark a folder a save is creating as written by the save with ``token``."""
    (folder / MARKER).write_text(token)


def carries_token(path: Path, token: str | None) -> bool:
    """Whether ``path`` (never followed if a symlink) holds headkit's ``token``: a folder's
    marker, or a safetensors file's metadata."""
    try:
        if token is None or path.is_symlink():
            return False
        if path.is_dir():
            marker = path / MARKER
            return not marker.is_symlink() and marker.is_file() and marker.read_text() == token
        return path.is_file() and path.suffix == ".safetensors" and _file_token(path) == token
    except (OSError, ValueError):
        return False


def _file_token(path: Path) -> Any:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size <= _MAX_HEADER:
            return None
        header = json.loads(f.read(size))
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta.get("token") if isinstance(meta, dict) else None


class PendingSave:
    """The record of one save: its token and the proven names of the save it replaces."""

    def __init__(self, root: Path, token: str, previous: Any) -> None:
        self.root, self.token, self.previous = root, token, previous
        self.replaces = sorted(n for n in owned_files(previous) if token_of(n))
        self.path = root / f"{PREFIX}{token}.json"

    def __enter__(self) -> PendingSave:
        record = {"format": "headkit-save", "token": self.token, "replaces": self.replaces}
        try:
            write_record(self.path, json.dumps(record))
            fsync_dir(self.root)
        except BaseException:  # e.g. the disk is full: no record of a save that never started
            self.path.unlink(missing_ok=True)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        manifest = read_raw(self.root / MANIFEST)
        if manifest is not None or exc_type is not None:
            replaced = self.replaces if exc_type is None else []
            _finish(self.root, self.token, replaced, in_use(manifest), self.previous)
        self.path.unlink(missing_ok=True)


def write_record(path: Path, text: str) -> None:
    """Write a save's record (created exclusively) and make it durable."""
    with open(path, "x", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def finish_killed_saves(root: Path) -> None:
    """On load: finish the records of saves that were killed, when the folder is writable and
    no save holds its lock right now (a live save finishes its own); never waits, never
    fails the load."""
    if not any(_RECORD.fullmatch(p.name) for p in root.glob(f"{PREFIX}*.json")):
        return
    if not os.access(root, os.W_OK) or containment_root(root) != root.resolve():
        return  # read-only, or a hub cache snapshot: never changed by a load
    with contextlib.suppress(OSError, ValueError), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a record not in headkit's form: the next save says so
        with folder_lock(root, timeout=0):
            recover(root)


def recover(root: Path) -> None:
    """Finish the records of saves that were killed (call with the folder lock held)."""
    records = [p for p in root.iterdir() if _RECORD.fullmatch(p.name)]
    if not records:
        return
    manifest = read_raw(root / MANIFEST)
    if manifest is None and (root / MANIFEST).exists():
        return  # an unreadable manifest: nothing can be told apart safely
    keep = in_use(manifest)
    for path in records:
        token = _RECORD.fullmatch(path.name).group(1)
        replaces = _read_record(path, token)
        if replaces is None:
            continue
        _finish(root, token, replaces, keep)
        path.unlink(missing_ok=True)


def _finish(
    root: Path, token: str, replaces: list[str], keep: set[str], previous: Any = None
) -> None:
    """Delete what the save of ``token`` created and the manifest does not ``keep``, then
    the names it ``replaces`` that are not kept and provably headkit's (by their marker or
    token, or by the checksums of the ``previous`` manifest)."""
    _remove_created(root, token, keep)
    for name in replaces:
        if name not in keep and (
            _provable(root, name) or _proven_by_checksums(root, name, previous)
        ):
            _delete(root / name)


def _read_record(path: Path, token: str) -> list[str] | None:
    """The names a record in headkit's form replaces; [] for a record torn while it was
    written (it carries nothing yet); None, with a warning, for anything else."""
    start = f'{{"format": "headkit-save", "token": "{token}"'
    why = "not a regular file"
    if path.is_file() and not path.is_symlink():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            text = None
        record = _json(text)
        if (
            text is not None
            and record is None
            and (start.startswith(text) or text.startswith(start))
        ):
            return []  # torn: the save was killed while writing its first bytes
        replaces = record.get("replaces", []) if isinstance(record, dict) else None
        if (
            isinstance(record, dict)
            and record.get("format") == "headkit-save"
            and record.get("token") == token
            and isinstance(replaces, list)
            and all(isinstance(n, str) for n in replaces)
            and isinstance(record.get("created", []), list)
        ):
            return replaces
        why = "not JSON in headkit's form" if record is None else "not in headkit's form"
    warnings.warn(
        f"ignored {str(path)!r}: {why}, so not a save record headkit wrote (nothing it names "
        "is deleted); delete it if it is not yours",
        stacklevel=5,
    )
    return None


def _json(text: str | None) -> Any:
    try:
        return json.loads(text) if text is not None else None
    except (ValueError, RecursionError):
        return None


def _provable(root: Path, name: str) -> bool:
    """A final name of headkit's form that carries its own token."""
    return carries_token(root / name, token_of(name))


def _remove_created(root: Path, token: str, keep: set[str]) -> None:
    """Remove what the save with ``token`` created and the manifest does not use: final
    names and temporary folders when they carry the token, temporary files by their name."""
    for name in created_names(token):
        path = root / name
        if name in keep or not os.path.lexists(path):
            continue
        final = token_of(name) is not None
        if carries_token(path, token) or (not final and not path.is_dir()):
            _delete(path)


def _proven_by_checksums(root: Path, name: str, manifest: Any) -> bool:
    """A file or folder of a save before tokens: exactly what the manifest it was saved
    under records, byte for byte (its heads checksum, its folder's ``files_sha256``)."""
    path = root / name
    if not isinstance(manifest, dict) or path.is_symlink():
        return False
    try:
        if name == manifest.get("weights"):
            return path.is_file() and sha256_file(path) == manifest.get("weights_sha256")
        for key, extra in (("backbone", _BACKBONE_FILES), ("adapter", set())):
            entry = manifest.get(key)
            if isinstance(entry, dict) and entry.get("path") == name and path.is_dir():
                sums = entry.get("files_sha256")
                entries = list(path.iterdir())
                names = {e.name for e in entries}
                return (
                    isinstance(sums, dict)
                    and bool(sums)
                    and all(e.is_file() and not e.is_symlink() for e in entries)
                    and set(sums) <= names
                    and not names - set(sums) - extra
                    and all(sha256_file(path / n) == sums[n] for n in sums)
                )
    except OSError:
        return False
    return False


def _delete(path: Path) -> None:
    """Delete a file, a symlink itself (never its target) or a folder with its contents; a
    folder's token marker goes last, so a save killed while deleting leaves a folder that
    still proves itself headkit's, and the next save (``recover``) finishes the deletion."""
    try:
        if path.is_dir() and not path.is_symlink():
            for entry in sorted(path.iterdir(), key=lambda e: e.name == MARKER):
                delete_entry(entry)
            path.rmdir()
        else:
            path.unlink(missing_ok=True)
    except OSError as e:
        warnings.warn(f"could not remove {str(path)!r}: {e}", stacklevel=4)


def delete_entry(entry: Path) -> None:
    """Delete one entry of a folder being deleted (a sub-folder with its contents)."""
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink()
