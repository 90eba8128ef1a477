"""What the exports share: sample batches to verify against eager, the tokenizer to ship, and
writing an export folder so that a failed export leaves the previous one in place.

An export is built in a temporary folder inside the target, verified there, and only then are
its files moved into the target (``os.replace`` per file); files a previous export of the same
format listed and this one does not write are removed. Nothing else in the folder is touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError

#: (batch, sequence length, padding side) of the batches an export is verified on: other shapes
#: than the example it was traced with, batch 1 included, padded on the right and on the left.
VERIFY_SHAPES = ((1, 5, "right"), (3, 23, "right"), (3, 23, "left"), (4, 9, "left"))


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
def export_folder(directory: str | os.PathLike, sidecar: str) -> Iterator[Path]:
    """A temporary folder inside ``directory`` to build an export in; on success its files
    replace those of the previous export (the ones its ``sidecar`` JSON lists under "files")."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-export-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        yield tmp
        previous = _listed(root / sidecar)
        written = sorted(p.name for p in tmp.iterdir())
        for name in written:
            target = root / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(tmp / name, target)
        for name in previous - set(written):
            if name and "/" not in name and name not in (".", ".."):
                (root / name).unlink(missing_ok=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _listed(sidecar: Path) -> set[str]:
    try:
        files = json.loads(sidecar.read_text()).get("files", [])
    except (OSError, ValueError, AttributeError):
        return set()
    return {f for f in files if isinstance(f, str)}


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
