"""The size guard: refuse a manifest whose heads the weights file cannot hold, before
anything is built or allocated.

Sizes come from the manifest; they are checked against the weights file, in O(heads), with
real widths: a head's input is the backbone's width when ``in_size`` is null (read from the
backbone's ``config.json`` where it is on disk, before the backbone is loaded), and each
pooling strategy says its own width ("mean+max" → 2 ×). Each head kind counts itself from its
config (``Head.parameter_count``, ``Head.tensor_count``; a kind that cannot is not checked
here). Two checks:

- parameters: a lower bound of what the manifest's heads need, against the values the file
  holds (a corrupt ``num_outputs`` or ``hidden_size`` must not allocate gigabytes);
- tensors: heads that need at least t₁, t₂, ... tensors (an MLP head one per layer) need
  t₁ + t₂ + ... in the file (150,000 layers of width 1 hold few parameters but take a
  minute and gigabytes to build).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..config import HeadConfig
from ..errors import CheckpointError
from ..heads.base import HEADS
from .manifest import TIED
from .paths import MANIFEST

_WIDTH_KEYS = ("hidden_size", "n_embd", "d_model", "dim", "hidden_dim")


def backbone_width(config_json: Path | None) -> int | None:
    """The hidden size a backbone's ``config.json`` declares, or None (not there, unknown)."""
    if config_json is None or not config_json.is_file():
        return None
    try:
        config = json.loads(config_json.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    for cfg in (config, config.get("text_config") if isinstance(config, dict) else None):
        if isinstance(cfg, dict):
            for key in _WIDTH_KEYS:
                value = cfg.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 24:
                    return value
    return None


def check_sizes(
    root: Path,
    manifest: dict[str, Any],
    state: dict[str, torch.Tensor],
    width: int | None,
) -> None:
    """Raise CheckpointError if the manifest's heads cannot fit ``state`` (see module doc)."""
    tied = {t.removeprefix("heads.").split(".", 1)[0] for t in manifest.get(TIED, [])}
    # (a head tied to the input embeddings has its matrix in the backbone, not the file)
    heads = [c for c in manifest["heads"] if isinstance(c, HeadConfig) and c.name not in tied]
    sizes = {c.name: _lower_bounds(c, width or 1) for c in heads}
    have = sum(t.numel() for t in state.values())
    need = sum(params or 0 for params, _ in sizes.values())
    if need > 2 * have + (1 << 20):
        raise CheckpointError(
            f"{MANIFEST} in {str(root)!r} describes heads with at least {need} "
            f"parameters, but {manifest['weights']!r} holds {have} values: they do not match"
        )
    tensors = {c.name: (sizes[c.name][1], c) for c in heads if sizes[c.name][1]}
    total = sum(t for t, _ in tensors.values())
    if total > len(state):
        most, cfg = max(tensors.values(), key=lambda tc: tc[0])
        raise CheckpointError(
            f"{MANIFEST} in {str(root)!r} describes heads of at least {total} tensors in all "
            f"(head {cfg.name!r}: {most}, num_layers={cfg.num_layers}), but "
            f"{manifest['weights']!r} holds {len(state)} tensors: they do not match"
        )


def _lower_bounds(cfg: HeadConfig, width: int) -> tuple[int | None, int | None]:
    """(parameters, tensors) a head of ``cfg`` holds at least, from its config alone: its
    kind's counts with the sizes the manifest may leave to the backbone taken at their
    smallest (the width when unknown and a pooler's width 1, a vocabulary of 1)."""
    if cfg.head_type not in HEADS:
        return None, None
    cls = HEADS.get(cfg.head_type)
    resolved = cfg.replace(in_size=cfg.in_size or width, num_outputs=cfg.num_outputs or 1)
    return cls.parameter_count(resolved, pooler_size=1), cls.tensor_count(resolved)
