"""What a save may delete: only files it wrote itself, recorded before it writes them.

Before a save writes anything it records, in ``.headkit-save-<token>.json``, the names it
may create (all carry its token) and the names it replaces (those the previous manifest
says its save wrote: see ``paths.owned_files``). After the commit it removes the replaced
names and its own temporaries — never a name the new manifest uses — and then the record.
A save that fails removes what it created. A record left by a save that was killed is
finished by the next save into the folder (under the folder lock, so that save is dead):
whatever the manifest in place does not use is removed. Nothing else in the folder is ever
touched: a user's ``heads-notes.md``, ``backbone-finetuned/`` or ``.tmp-data/`` stays.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

from .manifest import fsync_dir, fsync_file
from .paths import MANIFEST, owned_files, plain_name, read_raw, referenced_files

PREFIX = ".headkit-save-"
_RECORD = re.compile(r"\.headkit-save-([0-9a-f]{12})\.json")
#: What headkit names the files it writes: ``<kind>-<12 hex token>[.<ext>]``.
_OURS = re.compile(r"[a-z][a-z_]*-[0-9a-f]{12}(\.[a-z]+)?")


def in_use(manifest: Any) -> set[str]:
    """Every folder entry a (raw) manifest needs: never removed while it is in place."""
    return {MANIFEST} | owned_files(manifest) | referenced_files(manifest)


class PendingSave:
    """The record of one save: ``created`` names (with the save's token) and ``replaces``."""

    def __init__(self, root: Path, token: str, created: list[str], replaces: set[str]) -> None:
        self.root, self.token = root, token
        self.created = [n for n in created if token in n and plain_name(n)]
        self.replaces = sorted(n for n in replaces if _OURS.fullmatch(n))
        self.path = root / f"{PREFIX}{token}.json"

    def __enter__(self) -> PendingSave:
        record = {"format": "headkit-save", "token": self.token}
        record.update(created=self.created, replaces=self.replaces)
        self.path.write_text(json.dumps(record))
        fsync_file(self.path)
        fsync_dir(self.root)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        manifest = read_raw(self.root / MANIFEST)
        names = self.created + (self.replaces if exc_type is None else [])
        if manifest is not None or exc_type is not None:
            remove(self.root, names, keep=in_use(manifest))
        self.path.unlink(missing_ok=True)


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
        record = read_raw(path)
        if isinstance(record, dict) and record.get("token") == token:
            created = [n for n in record.get("created") or [] if isinstance(n, str)]
            replaces = {n for n in record.get("replaces") or [] if isinstance(n, str)}
            pending = PendingSave(root, token, created, replaces)
            remove(root, pending.created + pending.replaces, keep=keep)
        # an unreadable record was torn while being written: nothing was created after it
        path.unlink(missing_ok=True)


def remove(root: Path, names: list[str], keep: set[str]) -> None:
    """Delete ``root/name`` for each name not in ``keep`` (a symlink itself, never its
    target; a folder with its contents)."""
    for name in names:
        if name in keep or not plain_name(name):
            continue
        path = root / name
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        except OSError as e:
            warnings.warn(f"could not remove {str(path)!r}: {e}", stacklevel=3)
