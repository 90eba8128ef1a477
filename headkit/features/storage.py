"""Cached features on disk or in memory: raw arrays + ``manifest.json``, read as memmaps.

``CachedFeatures`` holds what ``cache_features`` computed; a directory of raw arrays
(``manifest.json`` + ``*.bin``; no pickle) is reopened with ``CachedFeatures.load`` without
reading it into RAM. The manifest may only name files inside its own folder.

The manifest records each array's file, shape, dtype and sha256, and the backbone the
features came from (class, sizes, ``tensors_fingerprint``). ``load`` checks all of it before
anything is used: every field's type, each file's size and (``verify=True``, the default; one
read of the cache) its checksum, that the arrays agree with the counts (rows per sequence or
token), and that token offsets start at 0, never decrease and end at the number of tokens.
Anything wrong is a CheckpointError saying what. Caches of format version 1 (before checksums)
are refused: rebuild them with ``overwrite=True``, which replaces a cache folder only when it
holds nothing but that cache (version 2: each file with the checksum its manifest records;
version 1: each file of headkit's name form with the size its manifest records).
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint.manifest import sha256_file, short_repr
from ..checkpoint.paths import MAX_NAME, check_inside, plain_name
from ..errors import BatchError, CheckpointError, ConfigError
from ..losses.objective import IGNORE_INDEX

FORMAT = "headkit-cached-features"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
#: The names of the array files a cache writes (``rank<r>-`` while ranks write their parts).
_FILE = re.compile(r"(rank[0-9]+-)?[0-9]{4,}\.bin")
#: The largest manifest read (bytes).
_MAX_MANIFEST = 16 << 20
#: The layouts of features and of labels.
_FEATURE_LAYOUTS = ("pooled", "tokens")
_LABEL_LAYOUTS = ("sequence", "token")
_NP_DTYPES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",  # stored as raw 16-bit words
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
_TORCH_DTYPES = {v: k for k, v in _NP_DTYPES.items()}


class CachedFeatures:
    """Cached head inputs and labels of a dataset (see the module docstring for the layout).

    Build with ``cache_features``; reopen a directory with ``CachedFeatures.load(path)``.
    ``arrays`` maps ``"offsets"``, ``"features/<key>"`` and ``"labels/<target>"`` to tensors
    (memmap-backed when loaded from disk); ``meta`` describes heads, labels and the backbone.
    """

    def __init__(
        self, arrays: dict[str, torch.Tensor], meta: dict[str, Any], path: Path | None = None
    ) -> None:
        self.arrays = arrays
        self.meta = meta
        self.path = path

    # ------------------------------------------------------------------ description
    def __len__(self) -> int:
        return int(self.meta["num_sequences"])

    @property
    def num_tokens(self) -> int:
        """Non-padding positions stored for token-layout heads (0 when there are none)."""
        return int(self.meta["num_tokens"])

    @property
    def heads(self) -> dict[str, dict[str, Any]]:
        """Per head: layout ("pooled" or "tokens"), feature key, hooked layer, pooling."""
        return self.meta["heads"]

    @property
    def labels(self) -> dict[str, torch.Tensor]:
        """Stored labels by target: (num_sequences, ...) or (num_tokens, ...) for token heads."""
        return {t: self.arrays[f"labels/{t}"] for t in self.meta["labels"]}

    def features(self, head: str) -> torch.Tensor:
        """What ``head`` reads: (num_sequences, width) or (num_tokens, hidden)."""
        return self.arrays[f"features/{self.heads[head]['features']}"]

    def __repr__(self) -> str:
        where = str(self.path) if self.path is not None else "memory"
        return (
            f"CachedFeatures({len(self)} sequences, {self.num_tokens} tokens, "
            f"heads={sorted(self.heads)}, storage={where})"
        )

    def to(self, device: torch.device | str) -> CachedFeatures:
        """An in-memory copy on ``device`` (e.g. to keep a small set on the GPU)."""
        arrays = {k: v.to(device) for k, v in self.arrays.items()}
        return CachedFeatures(arrays, json.loads(json.dumps(self.meta)))

    # ------------------------------------------------------------------ batches
    def batch(
        self, index: torch.Tensor, device: torch.device | str | None = None
    ) -> dict[str, Any]:
        """Rows ``index`` as ``{"features": {key: x}, "labels": {target: y}, "mask": m}``.

        Token-layout arrays come back right-padded to the longest sequence of the batch:
        (batch, seq, hidden), labels (batch, seq, ...) filled with -100 (or 0 where the
        dtype cannot hold it), and ``mask`` (batch, seq); ``mask`` is None without them.
        """
        index = torch.as_tensor(index, dtype=torch.long).cpu()
        out: dict[str, Any] = {"features": {}, "labels": {}, "mask": None}
        tok_index = mask = None
        if "offsets" in self.arrays:
            offsets = self.arrays["offsets"].cpu()
            starts, lengths = offsets[index], offsets[index + 1] - offsets[index]
            width = max(int(lengths.max()), 1) if len(index) else 1
            positions = torch.arange(width)
            mask = positions < lengths[:, None]  # (batch, seq)
            tok_index = (starts[:, None] + positions)[mask]  # (batch tokens,)
            out["mask"] = mask.long().to(device) if device is not None else mask.long()
        for key in self.meta["feature_keys"]:
            arr = self.arrays[f"features/{key}"]
            if self.meta["feature_keys"][key] == "pooled":
                x = _take(arr, index)
            else:
                x = _pad(_take(arr, tok_index), mask, 0)
            out["features"][key] = x.to(device) if device is not None else x
        for target, info in self.meta["labels"].items():
            arr = self.arrays[f"labels/{target}"]
            if info["layout"] == "sequence":
                y = _take(arr, index)
            else:
                fill = 0 if arr.dtype in (torch.bool, torch.uint8) else IGNORE_INDEX
                y = _pad(_take(arr, tok_index), mask, fill)
            out["labels"][target] = y.to(device) if device is not None else y
        return out

    # ------------------------------------------------------------------ disk
    def save(self, directory: str | PathLike, overwrite: bool = False) -> None:
        """Write to ``directory`` (raw arrays + ``manifest.json``, readable as memmaps)."""
        writer = _DiskWriter(Path(directory), overwrite)
        try:
            for name, arr in self.arrays.items():
                writer.append(name, arr)
            writer.finish(self.meta)
        except BaseException:
            writer.abort()
            raise

    @classmethod
    def load(cls, directory: str | PathLike, verify: bool = True) -> CachedFeatures:
        """Open a cache directory; arrays are memory-mapped, not read into RAM. Everything the
        manifest says is checked first (see the module docstring); ``verify=False`` skips only
        the checksums (which read the whole cache once)."""
        path = Path(directory)
        manifest = read_cache_manifest(path)
        where = path / MANIFEST
        arrays = {}
        for name, spec in manifest["arrays"].items():
            arrays[name] = _open_array(path, name, spec)
            if verify and sha256_file(path / spec["file"]) != spec["sha256"]:
                raise CheckpointError(
                    f"{where}: array {short_repr(name)} ({spec['file']}) does not have the "
                    "sha256 the manifest records: changed or swapped since it was cached; "
                    "cache the features again (overwrite=True)"
                )
        check_consistent(arrays, manifest["meta"], where)
        return cls(arrays, manifest["meta"], path)


def read_cache_manifest(path: Path) -> dict[str, Any]:
    """A cache folder's manifest, its form checked (CheckpointError naming what is wrong)."""
    manifest_path = path / MANIFEST
    if manifest_path.is_symlink() or not manifest_path.is_file():
        raise CheckpointError(
            f"{path}: no {MANIFEST}; not a headkit feature cache, or caching did not finish"
        )
    try:
        if manifest_path.stat().st_size > _MAX_MANIFEST:
            raise ValueError(f"larger than {_MAX_MANIFEST} bytes")
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({str(e)[:200]})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{manifest_path}: must hold a JSON object")
    version = manifest.get("version")
    if manifest.get("format") == FORMAT and version == 1:
        raise CheckpointError(
            f"{manifest_path}: a feature cache of format version 1, written before caches "
            "recorded checksums; cache the features again (cache_features(..., "
            "overwrite=True) replaces it)"
        )
    if manifest.get("format") != FORMAT or version != FORMAT_VERSION:
        raise CheckpointError(
            f"{manifest_path}: format={short_repr(manifest.get('format'))} "
            f"version={short_repr(version)}; expected {FORMAT!r} version {FORMAT_VERSION}"
        )
    if not isinstance(manifest.get("arrays"), dict) or not isinstance(manifest.get("meta"), dict):
        raise CheckpointError(f"{manifest_path}: 'arrays' and 'meta' must be JSON objects")
    for name, spec in manifest["arrays"].items():
        digest = spec.get("sha256") if isinstance(spec, dict) else None
        if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
            raise CheckpointError(
                f"{manifest_path}: array {short_repr(name)} records sha256="
                f"{short_repr(digest)}; expected 64 hex digits"
            )
    _check_meta(manifest["meta"], manifest_path)
    return manifest


def _check_meta(meta: dict[str, Any], where: Path) -> None:
    """The fields of ``meta`` the cache is read by, each of its type (CheckpointError)."""

    def bad(field: str, value: Any, allowed: str) -> CheckpointError:
        return CheckpointError(
            f"{where}: meta {field}={short_repr(value)} is invalid; expected {allowed}"
        )

    for field in ("num_sequences", "num_tokens"):
        value = meta.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**62:
            raise bad(field, value, "a count >= 0")
    keys = meta.get("feature_keys")
    if not isinstance(keys, dict) or not all(
        isinstance(k, str) and v in _FEATURE_LAYOUTS for k, v in keys.items()
    ):
        raise bad("feature_keys", keys, f"an object of key: {' or '.join(_FEATURE_LAYOUTS)}")
    labels = meta.get("labels")
    if not isinstance(labels, dict) or not all(
        isinstance(v, dict) and v.get("layout") in _LABEL_LAYOUTS for v in labels.values()
    ):
        raise bad("labels", labels, "an object of target: {'layout': 'sequence' or 'token'}")
    heads = meta.get("heads")
    head_fields = ("layout", "features", "layer", "pred_for_sequence", "pooling")
    if not isinstance(heads, dict) or not all(
        isinstance(h, dict) and all(f in h for f in head_fields) for h in heads.values()
    ):
        raise bad("heads", heads, f"an object of head: {{{', '.join(head_fields)}}}")
    for name, info in heads.items():
        if keys.get(info["features"]) != info["layout"]:
            raise bad(f"heads[{short_repr(name)}]", info, "features of a key in feature_keys")
    backbone = meta.get("backbone")
    if not isinstance(backbone, dict) or not all(
        f in backbone for f in ("class", "num_layers", "hidden_size")
    ):
        raise bad("backbone", backbone, "an object with class, num_layers, hidden_size")


def check_consistent(arrays: dict[str, torch.Tensor], meta: dict[str, Any], where: Any) -> None:
    """The arrays agree with ``meta``: one per feature key and label, with a row per sequence
    (or per token), and token offsets from 0 that never decrease and end at the token count."""
    sequences, tokens = meta["num_sequences"], meta["num_tokens"]
    wanted = {f"features/{k}": v == "tokens" for k, v in meta["feature_keys"].items()}
    wanted |= {f"labels/{t}": v["layout"] == "token" for t, v in meta["labels"].items()}
    for name, per_token in wanted.items():
        arr = arrays.get(name)
        rows = tokens if per_token else sequences
        if arr is None or arr.dim() == 0 or arr.shape[0] != rows:
            got = "missing" if arr is None else f"shape {tuple(arr.shape)}"
            raise CheckpointError(
                f"{where}: array {short_repr(name)} is {got}; expected {rows} rows (one per "
                f"{'token' if per_token else 'sequence'})"
            )
    if "offsets" not in arrays:
        if any(wanted.values()):
            raise CheckpointError(f"{where}: token arrays but no 'offsets' array")
        return
    offsets = arrays["offsets"]
    if offsets.dtype != torch.int64 or tuple(offsets.shape) != (sequences + 1,):
        raise CheckpointError(
            f"{where}: 'offsets' is {offsets.dtype} of shape {tuple(offsets.shape)}; expected "
            f"int64 of shape ({sequences + 1},)"
        )
    steps = offsets[1:] - offsets[:-1]
    if int(offsets[0]) != 0 or int(offsets[-1]) != tokens or bool((steps < 0).any()):
        at = int((steps < 0).nonzero()[0]) if bool((steps < 0).any()) else None
        why = (
            f"decrease at sequence {at}"
            if at is not None
            else f"run from {int(offsets[0])} to {int(offsets[-1])}"
        )
        raise CheckpointError(
            f"{where}: token offsets {why}; expected non-decreasing offsets from 0 to "
            f"num_tokens={tokens}"
        )


def _open_array(folder: Path, name: str, spec: Any) -> torch.Tensor:
    """Memory-map one array of a cache; its file must be a plain name inside ``folder``."""
    where = folder / MANIFEST
    if not isinstance(spec, dict):
        raise CheckpointError(f"{where}: array {name!r} is {spec!r}; expected an object")
    file_name, shape, dtype_name = spec.get("file"), spec.get("shape"), spec.get("dtype")
    if not plain_name(file_name) or file_name == MANIFEST:
        shown = repr(file_name) if len(repr(file_name)) <= 80 else repr(file_name)[:77] + "..."
        raise CheckpointError(
            f"{where}: array {name!r} names file {shown}; allowed: a plain file name (at most "
            f"{MAX_NAME} bytes) inside the cache folder"
        )
    file = folder / file_name
    if file.is_symlink():
        raise CheckpointError(f"{where}: {file_name!r} is a symlink; cache files must be plain")
    check_inside(file, folder, f"{where}: array file")
    if not isinstance(shape, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**62 for n in shape
    ):
        raise CheckpointError(f"{where}: array {name!r} has shape {shape!r}; a list of sizes")
    dtype = _TORCH_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise CheckpointError(f"{file}: unsupported dtype {dtype_name!r}")
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    size = file.stat().st_size if file.is_file() else -1
    if size != expected:
        raise CheckpointError(
            f"{file}: {size} bytes on disk, expected {expected} for shape {tuple(shape)} "
            f"{dtype_name} (missing or truncated)"
        )
    if expected == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    np_dtype = "int16" if dtype == torch.bfloat16 else dtype_name
    # mode "c": copy-on-write pages, so torch gets a writable view without a copy.
    mm = np.memmap(file, dtype=np_dtype, mode="c", shape=tuple(shape))
    t = torch.from_numpy(mm)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def _cache_files(path: Path) -> list[Path]:
    """The files of the cache in ``path`` that ``overwrite=True`` may delete, each proven to
    be what headkit wrote (see the module docstring); ConfigError, naming them, when the folder
    holds anything else (the user's files are never deleted)."""
    refuse = (
        f"storage={str(path)!r} holds files that are not a headkit feature cache; refusing to "
        "overwrite it"
    )
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        specs = manifest["arrays"]
        version = manifest["version"]
        files = {spec["file"]: spec for spec in specs.values()}
    except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError):
        raise ConfigError(f"{refuse} (no readable {MANIFEST})") from None
    if (path / MANIFEST).is_symlink():
        raise ConfigError(f"{refuse} ({MANIFEST} is a link)")
    proven = []
    others = []
    for entry in sorted(path.iterdir()):
        if entry.name == MANIFEST:
            continue
        spec = files.get(entry.name)
        if spec is not None and _proven(entry, spec, version):
            proven.append(entry)
        else:
            others.append(entry.name)
    if others:
        shown = ", ".join(repr(n[:80]) for n in others[:8])
        more = f" and {len(others) - 8} more" if len(others) > 8 else ""
        raise ConfigError(
            f"{refuse}: {shown}{more} (not an array its {MANIFEST} records with this content); "
            "move them, or choose an empty directory"
        )
    return proven


def _proven(file: Path, spec: dict[str, Any], version: Any) -> bool:
    """``file`` is an array headkit wrote as ``spec`` records: its sha256 (version 2), or
    for a version-1 cache (no checksums) its name form and exact size."""
    if file.is_symlink() or not file.is_file() or not _FILE.fullmatch(file.name):
        return False
    if version == 1:
        dtype = _TORCH_DTYPES.get(spec.get("dtype"))
        shape = spec.get("shape")
        if dtype is None or not isinstance(shape, list):
            return False
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return file.stat().st_size == size
    return isinstance(spec.get("sha256"), str) and sha256_file(file) == spec["sha256"]


# ---------------------------------------------------------------------- storage
def _take(arr: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return arr.index_select(0, index.to(arr.device))


def _pad(flat: torch.Tensor, mask: torch.Tensor, fill: int) -> torch.Tensor:
    """(tokens, ...) at the True positions of ``mask`` (batch, seq) → (batch, seq, ...)."""
    out = flat.new_full(tuple(mask.shape) + tuple(flat.shape[1:]), fill)
    out[mask.to(flat.device)] = flat
    return out


class _Writer:
    """Appends row blocks to named arrays, checking dtype and trailing shape stay the same."""

    def __init__(self) -> None:
        self.specs: dict[str, dict[str, Any]] = {}

    def append(self, name: str, t: torch.Tensor) -> None:
        t = t.detach()
        if t.dtype not in _NP_DTYPES:
            raise BatchError(f"{name}: dtype {t.dtype} cannot be cached; allowed: {_NP_DTYPES}")
        spec = self.specs.setdefault(
            name, {"dtype": _NP_DTYPES[t.dtype], "shape": [0, *t.shape[1:]]}
        )
        if spec["dtype"] != _NP_DTYPES[t.dtype] or spec["shape"][1:] != list(t.shape[1:]):
            raise BatchError(
                f"{name}: a batch gave {t.dtype} rows of shape {tuple(t.shape[1:])}, earlier "
                f"batches {spec['dtype']} rows of shape {tuple(spec['shape'][1:])}; labels and "
                "features must keep one dtype and shape across batches"
            )
        spec["shape"][0] += t.shape[0]
        self._write(name, t.cpu().contiguous())

    def _write(self, name: str, t: torch.Tensor) -> None:
        raise NotImplementedError

    def finish(self, meta: dict[str, Any]) -> CachedFeatures:
        raise NotImplementedError

    def abort(self) -> None:
        """Drop what was written (caching failed)."""


class _MemoryWriter(_Writer):
    def __init__(self) -> None:
        super().__init__()
        self.parts: dict[str, list[torch.Tensor]] = {}

    def _write(self, name: str, t: torch.Tensor) -> None:
        self.parts.setdefault(name, []).append(t.clone())

    def arrays(self) -> dict[str, torch.Tensor]:
        """What was appended, one tensor per array."""
        return {n: torch.cat(ps) if len(ps) > 1 else ps[0] for n, ps in self.parts.items()}

    def finish(self, meta: dict[str, Any]) -> CachedFeatures:
        return CachedFeatures(self.arrays(), meta)


class _DiskWriter(_Writer):
    """Raw arrays (native byte order) appended batch by batch; ``manifest.json`` written last.

    ``part`` (a file-name prefix such as ``"rank1-"``): one rank's part of a cache that rank 0
    prepared the folder of; its files are merged into rank 0's (``shards.py``).
    """

    def __init__(self, path: Path, overwrite: bool, part: str = "") -> None:
        super().__init__()
        self.path, self.part = path, part
        self.files: dict[str, Any] = {}
        if part:
            if not path.is_dir():
                raise ConfigError(
                    f"storage={str(path)!r}: this rank does not see the folder rank 0 "
                    "prepared; every rank must see the same folder (on several machines, a "
                    "shared filesystem), or cache in memory (storage='memory')"
                )
            return
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise ConfigError(f"storage={str(path)!r} is a file; a directory path is needed")
        if path.is_dir() and any(path.iterdir()):
            if not overwrite:
                raise ConfigError(
                    f"storage={str(path)!r} is not empty; pass overwrite=True to replace a "
                    "feature cache there, or choose an empty directory"
                )
            for f in _cache_files(path):
                f.unlink()
            (path / MANIFEST).unlink()
        path.mkdir(parents=True, exist_ok=True)

    def _write(self, name: str, t: torch.Tensor) -> None:
        if name not in self.files:
            file = self.path / f"{self.part}{len(self.files):04d}.bin"
            self.specs[name]["file"] = file.name
            self.files[name] = open(file, "wb")  # noqa: SIM115 (closed in finish/abort)
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        self.files[name].write(t.numpy().tobytes())  # native byte order, as memmap reads it

    def close(self) -> None:
        """Close the array files (the manifest is not written)."""
        for f in self.files.values():
            f.close()

    def finish(self, meta: dict[str, Any]) -> CachedFeatures:
        self.close()
        for spec in self.specs.values():  # from disk: the ranks' parts are merged by now
            spec["sha256"] = sha256_file(self.path / spec["file"])
        manifest = {"format": FORMAT, "version": FORMAT_VERSION, "arrays": self.specs}
        manifest["meta"] = meta
        tmp = self.path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(tmp, self.path / MANIFEST)
        return CachedFeatures.load(self.path)

    def abort(self) -> None:
        for name, f in self.files.items():
            f.close()
            try:
                (self.path / self.specs[name]["file"]).unlink()
            except OSError:
                warnings.warn(f"could not remove {self.specs[name]['file']}", stacklevel=2)
