"""Cached head inputs for frozen backbones: run the backbone once, train many probes on it.

``cache_features`` runs a frozen backbone over a dataset once (eval mode, no grad, only as
deep as the deepest hooked layer) and keeps what each head reads:

- ``"pooled"`` heads (sequence heads whose pooling has no trainable parameters): the pooled
  vector ``MLPHead.features(hidden, mask, pooler)``, one (width,) row per sequence.
- ``"tokens"`` heads (token heads, causal-LM heads, and sequence heads with a trainable
  pooling such as ``"attention"``): the hooked layer's states at the **non-padding positions
  only**, flattened to (num_tokens, hidden) with per-sequence ``offsets``. Batches are
  rebuilt right-padded to their longest sequence with a matching mask, so padding never
  takes space on disk. Heads on the same layer share one array.

Labels are stored beside, by target: (num_sequences, ...) for sequence heads and
(num_tokens, ...) at the same non-padding positions for token heads. Storage is memory or a
directory of raw arrays read back as numpy memmaps (``manifest.json`` + ``*.bin``; no pickle),
so sets larger than RAM work. ``train_heads_on_features`` then trains the heads with the same
loss computation as ``HeadedModel.forward`` (``head_loss`` + ``combine_losses``).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable, Mapping
from itertools import chain
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from .backbone import run_backbone
from .errors import BatchError, CheckpointError, ConfigError
from .losses import IGNORE_INDEX, LOSSES, head_loss, labels_as_tensor
from .model import HeadedModel

FORMAT = "headkit-cached-features"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
#: Batch keys passed to the backbone while caching (the other model inputs make no sense here).
_CACHE_INPUTS = ("input_ids", "attention_mask", "position_ids", "inputs_embeds", "token_type_ids")
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
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{manifest_path}: unreadable manifest ({e})") from None
        if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{manifest_path}: format={manifest.get('format')!r} "
                f"version={manifest.get('version')!r}; expected {FORMAT!r} version "
                f"{FORMAT_VERSION}"
            )
        arrays = {}
        for name, spec in manifest["arrays"].items():
            file = path / spec["file"]
            shape = tuple(spec["shape"])
            dtype = _TORCH_DTYPES.get(spec["dtype"])
            if dtype is None:
                raise CheckpointError(f"{file}: unsupported dtype {spec['dtype']!r}")
            expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            size = file.stat().st_size if file.is_file() else -1
            if size != expected:
                raise CheckpointError(
                    f"{file}: {size} bytes on disk, expected {expected} for shape {shape} "
                    f"{spec['dtype']} (missing or truncated)"
                )
            if expected == 0:
                arrays[name] = torch.empty(shape, dtype=dtype)
                continue
            np_dtype = "int16" if dtype == torch.bfloat16 else spec["dtype"]
            # mode "c": copy-on-write pages, so torch gets a writable view without a copy.
            mm = np.memmap(file, dtype=np_dtype, mode="c", shape=shape)
            t = torch.from_numpy(mm)
            arrays[name] = t.view(torch.bfloat16) if dtype == torch.bfloat16 else t
        return cls(arrays, manifest["meta"], path)


# ---------------------------------------------------------------------- caching
def cache_features(
    model: HeadedModel,
    dataset: Any,
    batch_size: int = 32,
    collate_fn: Any = None,
    storage: str | PathLike = "memory",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    overwrite: bool = False,
) -> CachedFeatures:
    """Run the frozen backbone over ``dataset`` once and keep every head's input and labels.

    ``dataset``: a map-style or iterable dataset of examples (batched in order with
    ``batch_size`` and ``collate_fn``, default ``HeadedCollator(model)``) or a ``DataLoader``;
    batches hold model inputs and head targets, as for ``HeadedModel.forward``.
    ``storage``: "memory" or a directory (created; an existing non-empty one needs
    ``overwrite=True``). ``dtype`` is the stored float type. Raises ConfigError if anything
    outside the heads is trainable (cached features would go stale as it trains).
    """
    check_frozen(model)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype={dtype!r} is invalid; a floating torch dtype (torch.float32...)")
    if isinstance(dataset, DataLoader):
        loader: Iterable = dataset
    else:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ConfigError(f"batch_size={batch_size!r} is invalid; an integer >= 1")
        if collate_fn is None:
            from .data import HeadedCollator

            collate_fn = HeadedCollator(model)
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate_fn)
    heads = _plan_heads(model)
    targets = _label_layouts(model)
    if isinstance(storage, str) and storage == "memory":
        writer: _Writer = _MemoryWriter()
    elif isinstance(storage, (str, PathLike)):
        writer = _DiskWriter(Path(storage), overwrite)
    else:
        raise ConfigError(f"storage={storage!r} is invalid; 'memory' or a directory path")
    need_tokens = any(info["layout"] == "tokens" for info in heads.values()) or any(
        layout == "token" for layout in targets.values()
    )
    try:
        total = len(loader)  # type: ignore[arg-type]
    except TypeError:
        total = None
    was_training = model.backbone.training
    model.backbone.eval()
    offsets = [0]
    present: set[str] | None = None
    try:
        bar = tqdm(
            loader,
            total=total,
            disable=not progress,
            desc="headkit: caching features",
            unit="batch",
        )
        with torch.no_grad():
            for i, batch in enumerate(bar):
                labels, lengths = _cache_batch(model, heads, targets, batch, writer, dtype)
                if present is None:
                    present = set(labels)
                elif set(labels) != present:
                    raise BatchError(
                        f"batch {i} has labels for targets {sorted(labels)} but earlier batches "
                        f"had {sorted(present)}; every batch needs the same targets"
                    )
                for n in lengths:
                    offsets.append(offsets[-1] + n)
        if present is None:
            raise BatchError("the dataset is empty: there is nothing to cache")
        if need_tokens:
            writer.append("offsets", torch.tensor(offsets, dtype=torch.long))
        meta = {
            "num_sequences": len(offsets) - 1,
            "num_tokens": offsets[-1] if need_tokens else 0,
            "dtype": str(dtype).removeprefix("torch."),
            "heads": heads,
            "feature_keys": {info["features"]: info["layout"] for info in heads.values()},
            "labels": {t: {"layout": targets[t]} for t in sorted(present)},
            "backbone": _backbone_meta(model),
        }
        return writer.finish(meta)
    except BaseException:
        writer.abort()
        raise
    finally:
        model.backbone.train(was_training)


def _cache_batch(
    model: HeadedModel,
    heads: dict[str, dict[str, Any]],
    targets: dict[str, str],
    batch: Any,
    writer: _Writer,
    dtype: torch.dtype,
) -> tuple[set[str], list[int]]:
    """Run the backbone on one batch and append its features and labels; (targets, lengths)."""
    inputs, mask, labels = _split_batch(model, batch)
    wanted = {info["layer"] for info in heads.values()}
    captured, _ = run_backbone(model.backbone, model.info, wanted, model.early_exit, inputs)
    ref = next(iter(captured.values()))  # (batch, seq, hidden)
    real = mask.bool() if mask is not None else torch.ones(ref.shape[:2], dtype=torch.bool)
    real = real.to(ref.device)
    causal = any(c.is_causal_lm for c in model.head_configs.values())
    if causal and not _contiguous(real):
        raise BatchError(
            "attention_mask has padding between real tokens; a causal-LM head's shifted "
            "labels cannot be cached then (pad on one or both ends only)"
        )
    done: set[str] = set()
    for name, info in heads.items():
        if info["features"] in done:
            continue  # heads on the same layer and pooling share one array
        done.add(info["features"])
        hidden = captured[info["layer"]]
        if info["layout"] == "pooled":
            x = model.heads[name].features(hidden, mask, model.info.pooler)  # (batch, width)
        else:
            x = hidden[real]  # (batch tokens, hidden)
        writer.append(f"features/{info['features']}", x.to(dtype))
    for target, y in labels.items():
        y = labels_as_tensor(y, ref.device, f"target {target!r}")
        if targets[target] == "sequence":
            if y.dim() == 0 or y.shape[0] != ref.shape[0]:
                raise BatchError(
                    f"target {target!r}: labels of shape {tuple(y.shape)} do not match the "
                    f"batch size {ref.shape[0]}"
                )
            writer.append(f"labels/{target}", y)
        else:
            if y.dim() < 2 or tuple(y.shape[:2]) != tuple(real.shape):
                raise BatchError(
                    f"target {target!r} (a token head's): labels of shape {tuple(y.shape)} do "
                    f"not match the inputs {tuple(real.shape)}"
                )
            _check_padding_unused(model, target, y, real)
            writer.append(f"labels/{target}", y[real])
    return set(labels), [int(n) for n in real.sum(1).tolist()]


def check_frozen(model: HeadedModel) -> None:
    """Raise ConfigError unless every trainable parameter lives in the heads or the weighting."""
    if not isinstance(model, HeadedModel):
        raise ConfigError(f"model must be a HeadedModel, got {type(model).__name__}")
    outside = [
        n
        for n, p in model.named_parameters()
        if p.requires_grad and not n.startswith(("heads.", "loss_weighting."))
    ]
    if outside:
        more = f" and {len(outside) - 3} more" if len(outside) > 3 else ""
        raise ConfigError(
            f"cannot cache features: parameter(s) {outside[:3]}{more} outside the heads require "
            "grad, so the backbone would change while the heads train and cached features would "
            "be stale; freeze it (HeadedModel(..., freeze_base_model=True), no trainable "
            "LoRA/peft adapters) or train through HeadedModel.forward"
        )


def _plan_heads(model: HeadedModel) -> dict[str, dict[str, Any]]:
    """Per head: what to store ("pooled" vector or "tokens"), under which key, from which layer."""
    hooks = model.hooked_layers()
    plan = {}
    for name, head in model.heads.items():
        cfg = model.head_configs[name]
        layer = hooks[name]
        trainable_pool = head.pooling is not None and any(
            p.requires_grad for p in head.pooling.parameters()
        )
        if cfg.pred_for_sequence and not trainable_pool:
            layout, key = "pooled", f"L{layer}.{cfg.pooling}"
        else:
            layout, key = "tokens", f"L{layer}.tokens"
        plan[name] = {
            "layout": layout,
            "features": key,
            "layer": layer,
            "pred_for_sequence": cfg.pred_for_sequence,
            "pooling": cfg.pooling,
        }
    return plan


def _label_layouts(model: HeadedModel) -> dict[str, str]:
    """Each target's layout: "sequence" (one label row per sequence) or "token"."""
    layouts: dict[str, str] = {}
    for cfg in model.head_configs.values():
        layout = "sequence" if cfg.pred_for_sequence else "token"
        if layouts.setdefault(cfg.target, layout) != layout:
            raise ConfigError(
                f"target {cfg.target!r} is read by both sequence and token heads; its labels "
                "cannot be cached in one layout (give the heads different targets)"
            )
    return layouts


def _split_batch(
    model: HeadedModel, batch: Any
) -> tuple[dict[str, Any], torch.Tensor | None, dict[str, Any]]:
    """Backbone inputs (as ``HeadedModel.forward`` builds them), attention mask, labels."""
    if not isinstance(batch, dict) and hasattr(batch, "keys"):
        batch = dict(batch)  # BatchEncoding, UserDict
    if not isinstance(batch, dict):
        raise BatchError(
            f"a batch must be a dict of model inputs and head targets, got {type(batch).__name__}"
        )
    if isinstance(batch.get("labels"), Mapping):  # HeadedCollator's labels={target: ...}
        rest = {k: v for k, v in batch.items() if k != "labels"}
        batch = {**batch["labels"], **rest}
    targets = {c.target for c in model.head_configs.values()}
    unknown = sorted(k for k in batch if k not in targets and k not in _CACHE_INPUTS)
    if unknown:
        raise BatchError(
            f"unexpected batch key(s) {unknown} while caching features; allowed: model inputs "
            f"{list(_CACHE_INPUTS)} and head targets {sorted(targets)}"
        )
    device = model.device
    inputs = {
        k: (v.to(device) if isinstance(v, torch.Tensor) else v)
        for k, v in batch.items()
        if k in _CACHE_INPUTS and v is not None
    }
    ref = inputs.get("input_ids", inputs.get("inputs_embeds"))
    if not isinstance(ref, torch.Tensor) or ref.dim() < 2 or 0 in ref.shape[:2]:
        shape = tuple(ref.shape) if isinstance(ref, torch.Tensor) else ref
        raise BatchError(
            f"a batch needs input_ids or inputs_embeds of shape (batch >= 1, seq >= 1), got "
            f"{shape!r}"
        )
    mask = inputs.get("attention_mask")
    if mask is not None and tuple(mask.shape) != tuple(ref.shape[:2]):
        raise BatchError(
            f"attention_mask of shape {tuple(mask.shape)} does not match the inputs "
            f"{tuple(ref.shape[:2])}"
        )
    if model.info.is_decoder and "position_ids" not in inputs and mask is not None:
        # Left padding: positions count real tokens only, as HeadedModel.forward does.
        inputs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
    params = model.info.forward_params
    inputs = {k: v for k, v in inputs.items() if k in params}
    if "use_cache" in params:
        inputs["use_cache"] = False
    labels = {k: v for k, v in batch.items() if k in targets and v is not None}
    return inputs, mask, labels


def _contiguous(real: torch.Tensor) -> bool:
    """Each row's real positions form one run (padding only at the ends)."""
    changes = (real[:, 1:] != real[:, :-1]).sum(1)
    return bool((changes <= 2).all()) and not bool(((changes == 2) & real[:, 0]).any())


def _check_padding_unused(
    model: HeadedModel, target: str, labels: torch.Tensor, real: torch.Tensor
) -> None:
    """Raise if a padding position counts in a token head's loss (the cache drops padding)."""
    pad = ~real
    if not bool(pad.any()):
        return
    for name, cfg in model.head_configs.items():
        if cfg.target != target or cfg.loss_fct is None or cfg.pred_for_sequence:
            continue
        spec = LOSSES.get(cfg.loss_fct)
        y, pred_pad, label_pad = labels, pad, pad
        if cfg.is_causal_lm:  # position t predicts the label at t + 1
            y, pred_pad, label_pad = labels[:, 1:], pad[:, :-1], pad[:, 1:]
        counts = ~label_pad if cfg.ignore_pads else torch.ones_like(label_pad)
        if spec.ignores_minus_100:
            kept = y != IGNORE_INDEX
            counts = counts & (kept.any(-1) if kept.dim() > 2 else kept)
        if bool((counts & (pred_pad | label_pad)).any()):
            raise BatchError(
                f"head {name!r} (target {target!r}): padding positions count in its loss "
                f"(ignore_pads={cfg.ignore_pads}, labels at padding are not {IGNORE_INDEX}), "
                "but cached features keep real tokens only; set the labels at padding to "
                f"{IGNORE_INDEX} or ignore_pads=True"
            )


def _backbone_meta(model: HeadedModel) -> dict[str, Any]:
    return {
        "class": type(model.backbone).__name__,
        "name_or_path": str(getattr(model.config, "name_or_path", "") or ""),
        "num_layers": model.info.num_layers,
        "hidden_size": model.info.hidden_size,
    }


# ---------------------------------------------------------------------- training
def train_heads_on_features(
    model: HeadedModel,
    features: CachedFeatures,
    epochs: int = 1,
    batch_size: int = 32,
    lr: float = 1e-3,
    optimizer: torch.optim.Optimizer | None = None,
    seed: int = 0,
    max_steps: int | None = None,
    progress: bool = False,
) -> list[float]:
    """Train the heads on cached features; return the mean total loss of each epoch.

    Each step computes exactly what ``HeadedModel.forward`` would (``head_loss`` per head,
    then ``model.combine_losses``), with the heads in train mode (dropout active). Epoch e
    visits rows in the order ``torch.randperm(n, generator=g)`` (its e-th call) with ``g``
    seeded once by ``seed``, in consecutive batches; ``torch.manual_seed(seed)`` is set
    first for dropout. Default optimizer: AdamW(lr) over the trainable head (and loss
    weighting) parameters. ``max_steps`` stops early.
    """
    check_frozen(model)
    for field, value, low in (("epochs", epochs, 1), ("batch_size", batch_size, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"{field}={value!r} is invalid; an integer >= {low}")
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
        raise ConfigError(f"max_steps={max_steps!r} is invalid; an integer >= 1 or None")
    plan = _training_plan(model, features)
    if not plan:
        raise ConfigError(
            f"no head has both a loss_fct and cached labels; cached targets: "
            f"{sorted(features.meta['labels'])}, heads: {_head_targets(model)}"
        )
    if optimizer is None:
        params = [
            p
            for p in chain(model.heads.parameters(), model.loss_weighting.parameters())
            if p.requires_grad
        ]
        if not params:
            raise ConfigError("no head parameter requires grad (all heads trainable=False)")
        optimizer = torch.optim.AdamW(params, lr=lr)
    device = model.device
    n = len(features)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    modes = model.heads.training, model.loss_weighting.training
    model.heads.train()
    model.loss_weighting.train()
    epoch_losses: list[float] = []
    steps = 0
    try:
        for epoch in range(epochs):
            order = torch.randperm(n, generator=generator)
            total, count = 0.0, 0
            starts = range(0, n, batch_size)
            bar = tqdm(starts, disable=not progress, desc=f"epoch {epoch + 1}/{epochs}")
            for start in bar:
                batch = features.batch(order[start : start + batch_size], device)
                loss = _batch_loss(model, plan, batch)
                if loss is None:
                    continue
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += float(loss.detach())
                count += 1
                steps += 1
                if max_steps is not None and steps >= max_steps:
                    break
            epoch_losses.append(total / count if count else float("nan"))
            if max_steps is not None and steps >= max_steps:
                break
    finally:
        model.heads.train(modes[0])
        model.loss_weighting.train(modes[1])
    return epoch_losses


@torch.no_grad()
def predict_on_features(
    model: HeadedModel, features: CachedFeatures, batch_size: int = 256
) -> dict[str, torch.Tensor]:
    """Every head's predictions in eval mode, in cache order.

    Sequence heads: (num_sequences, num_outputs); token heads: (num_tokens, num_outputs),
    aligned with ``features.labels[target]``.
    """
    _check_matches(model, features, model.heads.keys())
    was = model.heads.training
    model.heads.eval()
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in model.heads}
    try:
        for start in range(0, len(features), batch_size):
            index = torch.arange(start, min(start + batch_size, len(features)))
            batch = features.batch(index, model.device)
            for name in model.heads:
                p = _head_preds(model, name, features.heads[name], batch)
                if not model.head_configs[name].pred_for_sequence:
                    p = p[batch["mask"].bool()]
                parts[name].append(p.cpu())
    finally:
        model.heads.train(was)
    return {name: torch.cat(ps) for name, ps in parts.items()}


def _head_targets(model: HeadedModel) -> dict[str, str | None]:
    return {n: c.target for n, c in model.head_configs.items()}


def _check_matches(model: HeadedModel, features: CachedFeatures, names: Iterable[str]) -> None:
    """Raise ConfigError if the cache was made for different heads or another backbone."""
    if not isinstance(features, CachedFeatures):
        raise ConfigError(
            f"features must be CachedFeatures (from cache_features), got {type(features).__name__}"
        )
    cached_bb, bb = features.meta["backbone"], _backbone_meta(model)
    for field in ("class", "num_layers", "hidden_size"):
        if cached_bb[field] != bb[field]:
            raise ConfigError(
                f"features were cached from another backbone: {field}={cached_bb[field]!r}, "
                f"this model has {bb[field]!r}"
            )
    now = _plan_heads(model)
    for name in names:
        if name not in features.heads:
            raise ConfigError(
                f"head {name!r} has no cached features (cached heads: {sorted(features.heads)}); "
                "cache the features again after adding heads"
            )
        for field in ("layout", "layer", "pred_for_sequence", "pooling"):
            if features.heads[name][field] != now[name][field]:
                raise ConfigError(
                    f"head {name!r}: cached with {field}={features.heads[name][field]!r} but "
                    f"the model's head has {field}={now[name][field]!r}; cache the features again"
                )


def _training_plan(model: HeadedModel, features: CachedFeatures) -> dict[str, Any]:
    """Heads that get a loss, with the config their loss is computed with."""
    cached = features.meta["labels"]
    names = [
        n for n, c in model.head_configs.items() if c.loss_fct is not None and c.target in cached
    ]
    _check_matches(model, features, names)
    plan = {}
    for name in names:
        cfg = model.head_configs[name]
        if not cfg.pred_for_sequence:
            # Rebuilt batches pad on the right, and caching checked that padding never counted
            # in this head's loss: ignoring padding gives the same loss as the original batches.
            cfg = cfg.replace(ignore_pads=True)
        plan[name] = (cfg, features.heads[name])
    return plan


def _head_preds(
    model: HeadedModel, name: str, info: dict[str, Any], batch: dict[str, Any]
) -> torch.Tensor:
    head = model.heads[name]
    x = batch["features"][info["features"]]
    if info["layout"] == "pooled" or not info["pred_for_sequence"]:
        return head.from_features(x)
    return head(x, batch["mask"], model.info.pooler)  # trainable pooling runs on token states


def _batch_loss(
    model: HeadedModel, plan: dict[str, Any], batch: dict[str, Any]
) -> torch.Tensor | None:
    losses = {}
    for name, (cfg, info) in plan.items():
        p = _head_preds(model, name, info, batch)
        losses[name] = head_loss(cfg, p, batch["labels"][cfg.target], batch["mask"])
    total, _ = model.combine_losses(losses)
    return total


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

    def finish(self, meta: dict[str, Any]) -> CachedFeatures:
        arrays = {n: torch.cat(ps) if len(ps) > 1 else ps[0] for n, ps in self.parts.items()}
        return CachedFeatures(arrays, meta)


class _DiskWriter(_Writer):
    """Raw arrays (native byte order) appended batch by batch; ``manifest.json`` written last."""

    def __init__(self, path: Path, overwrite: bool) -> None:
        super().__init__()
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
        self.path = path
        self.files: dict[str, Any] = {}

    def _write(self, name: str, t: torch.Tensor) -> None:
        if name not in self.files:
            file = self.path / f"{len(self.files):04d}.bin"
            self.specs[name]["file"] = file.name
            self.files[name] = open(file, "wb")  # noqa: SIM115 (closed in finish/abort)
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        self.files[name].write(t.numpy().tobytes())  # native byte order, as memmap reads it

    def finish(self, meta: dict[str, Any]) -> CachedFeatures:
        for f in self.files.values():
            f.close()
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


__all__ = [
    "CachedFeatures",
    "cache_features",
    "check_frozen",
    "predict_on_features",
    "train_heads_on_features",
]
