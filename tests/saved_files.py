"""What two saves of one model should share, file by file: for comparing a folder written from
one device with one written from another (or with another option spelling the default)."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Collection
from pathlib import Path

#: A save's token in file and folder names (``heads-<token>.safetensors``, ``backbone-<token>/``).
_TOKEN = re.compile(r"-[0-9a-f]{12}(?=[./]|$)")
#: A checkpoint's files that name the save's token (the manifest, the model card) and the token
#: file itself: they differ between any two saves.
PER_SAVE = frozenset({"head_configs.json", "README.md", ".headkit-token"})


def saved_files(folder: Path, skip: Collection[str] = PER_SAVE) -> dict[str, bytes]:
    """Each file under ``folder`` (its path with the save token replaced by ``-TOKEN``) and its
        bytes; a safetensors file's header without the token headkit records in its metadata
        (JSON with sorted keys: safetensors writes the metadata in no fixed order), then its
        tensors' bytes as written. Files named in ``skip`` are left out (default: those of a
    checkpoint that name the save itself; an export names none, but its card names its folder)."""
    out = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if path.name in skip:
            continue
        name = _TOKEN.sub("-TOKEN", path.relative_to(folder).as_posix())
        data = path.read_bytes()
        if path.suffix == ".safetensors":
            (size,) = struct.unpack("<Q", data[:8])
            header = json.loads(data[8 : 8 + size])
            header.get("__metadata__", {}).pop("token", None)
            data = json.dumps(header, sort_keys=True).encode() + b"\n" + data[8 + size :]
        out[name] = data
    return out
