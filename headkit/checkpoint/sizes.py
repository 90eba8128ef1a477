"""The size guard: refuse a manifest whose heads the weights file cannot hold, before
anything is built or allocated.

Sizes come from the manifest; they are checked against the weights file, in O(heads), with
real widths: a head's input is the backbone's width when ``in_size`` is null (read from the
backbone's ``config.json`` where it is on disk, before the backbone is loaded), times the
number of concatenated poolings ("mean+max" → 2 ×). Two checks:

- parameters: a lower bound of what the manifest's MLP heads need, against the values the
  file holds (a corrupt ``num_outputs`` or ``hidden_size`` must not allocate gigabytes);
- layers: MLP heads of ``num_layers`` n₁, n₂, ... need at least n₁ + n₂ + ... tensors in
  the file (150,000 layers of width 1 hold few parameters but take a minute and gigabytes
  to build).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..config import HeadConfig
from ..errors import CheckpointError
from .manifest import TIED
from .paths import MANIFEST

#: Poolings whose output is as wide as the hooked layer (one slice of a concatenation).
_FULL_WIDTH = {"first", "last", "cls", "mean", "mean_sqrt_len", "max", "weighted_mean", "attention"}
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
    heads = [
        c
        for c in manifest["heads"]
        if isinstance(c, HeadConfig) and c.head_type == "mlp" and c.name not in tied
    ]  # (a head tied to the input embeddings has its matrix in the backbone, not the file)
    have = sum(t.numel() for t in state.values())
    need = sum(_min_mlp_numel(c, width or 1) for c in heads)
    if need > 2 * have + (1 << 20):
        raise CheckpointError(
            f"{MANIFEST} in {str(root)!r} describes heads with at least {need} "
            f"parameters, but {manifest['weights']!r} holds {have} values: they do not match"
        )
    layers = sum(c.num_layers for c in heads)
    if layers > len(state):
        deepest = max(heads, key=lambda c: c.num_layers)
        raise CheckpointError(
            f"{MANIFEST} in {str(root)!r} describes heads with {layers} layers in all (head "
            f"{deepest.name!r}: num_layers={deepest.num_layers}), but {manifest['weights']!r} "
            f"holds {len(state)} tensors (at least one per layer): they do not match"
        )


def _min_mlp_numel(cfg: HeadConfig, width: int) -> int:
    """A lower bound on an MLP head's parameter count from its config alone (no allocation)."""
    n_in = cfg.in_size or width
    if cfg.pred_for_sequence:
        strategies = cfg.pooling_strategies or ["first"]
        n_in = sum(n_in if s in _FULL_WIDTH else 1 for s in strategies)
    n_out, n, hidden = cfg.num_outputs or 1, cfg.num_layers, cfg.hidden_size
    return n_in * n_out if n == 1 else n_in * hidden + (n - 2) * hidden * hidden + hidden * n_out
