"""What the exports share: sample batches to verify against eager, the tokenizer to ship, and
writing an export folder so that a failed export leaves the previous one in place.

An export is built in a temporary folder inside the target, verified there, and only then are
its files moved into the target (``os.replace`` per file). The target must be new, empty, or an
earlier export of the same format (replaced only with ``overwrite=True``); of an earlier export
only the files whose sha256 its sidecar records, and which still have it, are replaced or
removed. Nothing else in the folder is touched.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.manifest import MANIFEST as _CHECKPOINT_MANIFEST
from ..checkpoint.manifest import sha256_file
from ..checkpoint.paths import plain_name
from ..errors import ConfigError

#: (batch, sequence length, padding side) of the batches an export is verified on: other shapes
#: than the example it was traced with, batch 1 included, padded on the right and on the left.
VERIFY_SHAPES = ((1, 5, "right"), (3, 23, "right"), (3, 23, "left"), (4, 9, "left"))
#: The largest export sidecar read (bytes).
_MAX_SIDECAR = 16 << 20


def sample_batches(
    vocab: int,
    max_length: int | None,
    device: torch.device,
    *,
    avoid: int | None = None,
    token_types: int = 0,
    seed: int = 0,
    sides: tuple[str, ...] = ("right", "left"),
) -> Iterator[dict[str, torch.Tensor]]:
    """Random batches of ``VERIFY_SHAPES`` (lengths capped at ``max_length``): ids in
    ``0..vocab-1`` (never ``avoid``, e.g. the pad id), rows of different lengths padded on
    the shape's side (padding holds ``avoid`` when given), ``token_type_ids`` (0 then 1 for
    the second half of a row) when ``token_types`` > 1. ``sides``: the padding sides to give."""
    g = torch.Generator().manual_seed(seed)
    for batch, seq, side in VERIFY_SHAPES:
        if side not in sides:
            continue
        seq = min(seq, max_length) if max_length else seq
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        if avoid is not None:
            ids = torch.where(ids == avoid, (avoid + 1) % vocab, ids)
        lengths = [seq - (i * 3) % max(seq // 2, 1) for i in range(batch)]  # row 0 unpadded
        mask = torch.zeros(batch, seq, dtype=torch.long)
        for i, n in enumerate(lengths):
            if side == "right":
                mask[i, :n] = 1
            else:
                mask[i, seq - n :] = 1
        if avoid is not None:
            ids = torch.where(mask.bool(), ids, torch.full_like(ids, avoid))
        out = {"input_ids": ids, "attention_mask": mask}
        if token_types > 1:
            types = torch.zeros_like(ids)
            types[:, seq // 2 :] = 1
            out["token_type_ids"] = types * mask
        yield {k: v.to(device) for k, v in out.items()}


def max_difference(
    ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor, per_token: bool
) -> float:
    """Largest absolute difference; for per-token outputs at real tokens only (what a model
    computes at padding is not defined)."""
    ours, theirs = ours.detach().float().cpu(), torch.as_tensor(theirs).float().cpu()
    if ours.shape != theirs.shape:
        return float("inf")
    diff = (ours - theirs).abs()
    if per_token:
        diff = diff[mask.bool().cpu()]
    return float(diff.max()) if diff.numel() else 0.0


def recorded_tokenizer(model: Any) -> Any:
    """The tokenizer found beside the model's source (a local folder or the hub cache),
    or None: nothing is downloaded."""
    from transformers import AutoTokenizer

    source = getattr(getattr(model, "source", None), "source", None)
    names = [source, getattr(model.backbone.config, "name_or_path", None)]
    for name in [n for n in names if n]:
        try:
            return AutoTokenizer.from_pretrained(
                str(name), trust_remote_code=False, local_files_only=True
            )
        except (OSError, ValueError, TypeError, KeyError):
            continue
    return None


def check_atol(atol: Any) -> None:
    """Refuse a verification tolerance that is not a finite number >= 0 (ConfigError)."""
    ok = isinstance(atol, (int, float)) and not isinstance(atol, bool)
    if not ok or not math.isfinite(atol) or atol < 0:
        text = repr(atol)[:80]
        raise ConfigError(
            f"atol={text} is invalid; allowed: a finite number >= 0 (the largest |difference| "
            "from the model an export may show, default 1e-4)"
        )


def check_heads(model: Any, heads: Any, where: str) -> list[str]:
    """The names of the heads to export (all when ``heads`` is None), each one of the model's."""
    if heads is None:
        names = list(model.head_configs)
    else:
        names = [heads] if isinstance(heads, str) else list(heads)
    unknown = [n for n in names if n not in model.head_configs]
    if unknown or not names:
        raise ConfigError(
            f"{where}: heads={heads!r} names {unknown or 'no head'}; the model's heads: "
            f"{list(model.head_configs)}"
        )
    return names


@contextlib.contextmanager
def export_folder(
    directory: str | os.PathLike, sidecar: str, *, overwrite: bool = False, what: str = "export"
) -> Iterator[Path]:
    """A temporary folder inside ``directory`` to build an export in; on success its files
    are moved into ``directory``.

    ``directory`` must be new, empty, or an earlier export of the same kind (its ``sidecar``
    in headkit's form), which is replaced only with ``overwrite`` (checked before anything is
    built). Only files headkit can prove it wrote are replaced or deleted: those whose sha256
    the earlier sidecar records (``files_sha256``) and the file still has. A name the new
    export writes that exists and is not proven so is refused (nothing is moved); whatever a
    sidecar merely lists is never deleted, nor a checkpoint's manifest.
    """
    root = Path(directory)
    proven = check_export_target(root, sidecar, overwrite, what)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-export-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        yield tmp
        written = sorted(p.name for p in tmp.iterdir())
        foreign = [
            n for n in written if n != sidecar and os.path.lexists(root / n) and n not in proven
        ]
        if foreign:
            raise ConfigError(
                f"{str(root)!r}: the {what} would replace {_names(foreign)}, which headkit did "
                "not write (no checksum of an earlier export matches); nothing was written: "
                "move them or export into a new folder"
            )
        for name in written:
            os.replace(tmp / name, root / name)
        for name in sorted(set(proven) - set(written)):
            if name != _CHECKPOINT_MANIFEST and _unchanged(root / name, proven[name]):
                (root / name).unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_export_target(root: Path, sidecar: str, overwrite: bool, what: str) -> dict[str, str]:
    """Refuse ``root`` as an export folder (see ``export_folder``) before anything is built;
    return the files of an earlier export there that headkit can prove it wrote
    (name → sha256, each checked again before it is touched)."""
    if root.is_symlink() or (root.exists() and not root.is_dir()):
        raise ConfigError(f"directory={str(root)!r} is a file or a link; a folder is written")
    if not root.is_dir():
        return {}
    names = sorted(p.name for p in root.iterdir())
    if not names:
        return {}
    earlier = _earlier(root / sidecar)
    if earlier is None:
        raise ConfigError(
            f"directory={str(root)!r} is a folder with files that are not an earlier {what} "
            f"({_names(names)}); choose a new or empty folder"
        )
    if not overwrite:
        raise ConfigError(
            f"directory={str(root)!r} holds an earlier {what} already; pass overwrite=True "
            "(--overwrite) to replace it"
        )
    return {
        n: digest
        for n, digest in earlier.items()
        if plain_name(n) and n != _CHECKPOINT_MANIFEST and _unchanged(root / n, digest)
    }


def files_sha256(folder: Path, sidecar: str) -> dict[str, str]:
    """The sha256 of every file an export built in ``folder`` (its sidecar aside): what a
    later export may replace."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.is_symlink())
    return {p.name: sha256_file(p) for p in files if p.name != sidecar}


def _earlier(sidecar: Path) -> dict[str, str] | None:
    """The checksums an earlier export's sidecar records ({} for one from before they were
    recorded: nothing of it is proven), or None when there is no sidecar in headkit's form."""
    if sidecar.is_symlink() or not sidecar.is_file() or sidecar.stat().st_size > _MAX_SIDECAR:
        return None
    try:
        data = json.loads(sidecar.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not str(data.get("format", "")).startswith("headkit-"):
        return None
    sums = data.get("files_sha256")
    if not isinstance(sums, dict):
        return {}
    return {n: d for n, d in sums.items() if isinstance(n, str) and isinstance(d, str)}


def _unchanged(path: Path, digest: str) -> bool:
    """``path`` is a plain file (never a link) whose bytes still have ``digest``."""
    try:
        return not path.is_symlink() and path.is_file() and sha256_file(path) == digest
    except OSError:
        return False


def _names(names: list[str], shown: int = 8) -> str:
    text = ", ".join(repr(n[:80]) for n in names[:shown])
    return text + (f" and {len(names) - shown} more" if len(names) > shown else "")


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
