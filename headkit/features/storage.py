"""Cached features on disk or in memory: raw arrays + ``manifest.json``, read as memmaps.

``CachedFeatures`` holds what ``cache_features`` computed; a directory of raw arrays
(``manifest.json`` + ``*.bin``; no pickle) is reopened with ``CachedFeatures.load`` without
reading it into RAM. The manifest may only name files inside its own folder.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint.paths import MAX_NAME, check_inside, plain_name
from ..errors import BatchError, CheckpointError, ConfigError
from ..losses.objective import IGNORE_INDEX

FORMAT = "headkit-cached-features"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
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
    def load(cls, directory: str | PathLike) -> CachedFeatures:
        """Open a cache directory; arrays are memory-mapped, not read into RAM."""
        path = Path(directory)
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise CheckpointError(
                f"{path}: no {MANIFEST}; not a headkit feature cache, or caching did not finish"
            )
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError, RecursionError) as e:
            raise CheckpointError(f"{manifest_path}: unreadable manifest ({e})") from None
        if not isinstance(manifest, dict):
            raise CheckpointError(f"{manifest_path}: must hold a JSON object")
        if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{manifest_path}: format={manifest.get('format')!r} "
                f"version={manifest.get('version')!r}; expected {FORMAT!r} version "
                f"{FORMAT_VERSION}"
            )
        if not isinstance(manifest.get("arrays"), dict) or not isinstance(
            manifest.get("meta"), dict
        ):
            raise CheckpointError(f"{manifest_path}: 'arrays' and 'meta' must be JSON objects")
        arrays = {name: _open_array(path, name, spec) for name, spec in manifest["arrays"].items()}
        return cls(arrays, manifest["meta"], path)


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
        if path.exists() and not path.is_dir():
            raise ConfigError(f"storage={str(path)!r} is a file; a directory path is needed")
        if path.is_dir() and any(path.iterdir()):
            if not overwrite:
                raise ConfigError(
                    f"storage={str(path)!r} is not empty; pass overwrite=True to replace a "
                    "feature cache there, or choose an empty directory"
                )
            if not (path / MANIFEST).is_file() or any(
                f.name != MANIFEST and f.suffix != ".bin" for f in path.iterdir()
            ):
                raise ConfigError(
                    f"storage={str(path)!r} holds files that are not a headkit feature cache; "
                    "refusing to overwrite it"
                )
            for f in path.iterdir():
                f.unlink()
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
