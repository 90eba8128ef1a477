"""Cheap fingerprints of a backbone: of its weight files, and of its tensors as loaded.

Two questions, two answers, both O(number of tensors or files), never O(parameters):

- *Is the referenced backbone the one these heads were saved with?* ``files_fingerprint``
  hashes each weight file's size, its safetensors header (every tensor's name, dtype, shape
  and offsets) or, for other files (GGUF), its first 64 KiB, and 64 KiB of bytes at five
  fixed offsets, plus ``config.json`` and the dtypes the tensors were loaded in.
  ``tensors_fingerprint`` does the same from memory (names, shapes, dtypes and a fixed
  sample of each tensor's elements) when no weight file is known.
- *Was the backbone changed since it was loaded?* ``LoadStamp`` records, per tensor, its
  storage pointer, autograd version counter and a sample of its elements; ``unchanged``
  compares them.

``docs/checkpoints.md`` says exactly what each detects and what it does not.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

#: Bytes read at each sampled offset of a weight file.
CHUNK = 64 * 1024
#: Fractions of a file's data region where a chunk is read (the last one ends at the end).
OFFSETS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: Elements sampled from each tensor (evenly spaced over its flattened storage order).
SAMPLE = 256
#: Largest safetensors header read (bigger ones are treated as opaque bytes).
MAX_HEADER = 100 * 1024 * 1024


def files_fingerprint(files: Iterable[Path], dtypes: Iterable[torch.dtype], config: Path | None):
    """``"files:<sha256>"`` over each file's name, size, header and sampled bytes, the
    ``config.json`` bytes and the dtypes the tensors were loaded in."""
    h = hashlib.sha256(b"headkit-files-fingerprint-1\0")
    for path in sorted(files, key=lambda p: p.name):
        h.update(f"{path.name}\0".encode())
        _hash_file(h, path)
    if config is not None and config.is_file():
        h.update(b"config\0" + config.read_bytes())
    h.update(" ".join(sorted({str(d) for d in dtypes})).encode())
    return "files:" + h.hexdigest()


def _hash_file(h, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{size}\0".encode())
    with open(path, "rb") as f:
        start = 0
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if path.suffix == ".safetensors" and 0 < n <= min(MAX_HEADER, size - 8):
            h.update(head + f.read(n))  # every tensor's name, dtype, shape and offsets
            start = 8 + n
        else:
            f.seek(0)
            h.update(f.read(CHUNK))  # e.g. a GGUF header and the start of its metadata
        span = max(size - start - CHUNK, 0)
        for frac in OFFSETS:
            f.seek(start + int(span * frac))
            h.update(f.read(CHUNK))


def _sample(t: torch.Tensor) -> bytes:
    """A fixed sample of ``t``'s elements as bytes (on CPU; no copy of the whole tensor)."""
    flat = t.detach().reshape(-1) if t.is_contiguous() else t.detach().flatten()
    n = flat.numel()
    if n == 0 or flat.device.type == "meta":
        return b""
    k = min(SAMPLE, n)
    index = torch.arange(k, dtype=torch.int64) * (n - 1) // max(k - 1, 1)  # first .. last
    values = flat.index_select(0, index.to(flat.device)).cpu()
    if values.dtype in (torch.bfloat16, torch.float16):
        values = values.view(torch.int16)
    elif values.dtype == torch.bool:
        values = values.to(torch.uint8)
    try:
        return values.numpy().tobytes()
    except (TypeError, RuntimeError):  # dtypes numpy lacks (float8, ...)
        return repr(values.float().tolist()).encode()


def tensors_fingerprint(module: torch.nn.Module) -> str:
    """``"tensors:<sha256>"`` over every tensor's name, shape, dtype and sampled elements."""
    h = hashlib.sha256(b"headkit-tensors-fingerprint-1\0")
    with torch.no_grad():
        for name, t in module.state_dict().items():
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
            h.update(_sample(t))
    return "tensors:" + h.hexdigest()


@dataclass(frozen=True)
class _TensorStamp:
    shape: tuple[int, ...]
    dtype: torch.dtype
    ptr: int
    version: int
    sample: bytes


class LoadStamp:
    """What a backbone's tensors looked like when it was loaded, to tell later whether it
    changed: ``unchanged(module)`` is False after an in-place change through autograd's view
    of a tensor (``add_``, ``copy_``, an optimizer step, ``load_state_dict``), a replaced,
    added, removed, reshaped or re-typed tensor, or a change to any sampled element (which
    also catches most writes through ``.data``). A tensor moved to another device counts as
    unchanged when its sampled elements are equal. Either side may be a module or a mapping
    of its tensors (e.g. a LoRA backbone's base view, under the names it had before peft)."""

    def __init__(self, module: torch.nn.Module | Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self._tensors = {n: _stamp(t) for n, t in _tensors(module).items()}

    def unchanged(self, module: torch.nn.Module | Mapping[str, torch.Tensor]) -> bool:
        now = _tensors(module)
        if now.keys() != self._tensors.keys():
            return False
        with torch.no_grad():
            for name, t in now.items():
                old = self._tensors[name]
                if tuple(t.shape) != old.shape or t.dtype != old.dtype:
                    return False
                if t.data_ptr() == old.ptr and t._version != old.version:
                    return False
                if _sample(t) != old.sample:
                    return False
        return True


def _tensors(module: torch.nn.Module | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    return module if isinstance(module, Mapping) else module.state_dict(keep_vars=True)


def _stamp(t: torch.Tensor) -> _TensorStamp:
    return _TensorStamp(tuple(t.shape), t.dtype, t.data_ptr(), t._version, _sample(t))


def weight_files(folder: Path) -> list[Path]:
    """The safetensors weight files transformers loads from a model folder."""
    return sorted(p for p in folder.glob("*.safetensors") if p.is_file())
