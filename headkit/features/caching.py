"""Cached head inputs for frozen backbones: run the backbone once, train many probes on it.

``cache_features`` runs a frozen backbone over a dataset once (eval mode, no grad, only as
deep as the deepest hooked layer) and keeps what each head reads:

- ``"pooled"`` heads (sequence heads whose pooling has no trainable parameters): the pooled
  vector ``Head.features(hidden, mask)``, one (width,) row per sequence.
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

from collections.abc import Iterable
from os import PathLike
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ..backbone.fingerprint import tensors_fingerprint
from ..backbone.inputs import batch_inputs, drop_tokenizer_extras, prepare_inputs, run_stage
from ..backbone.modalities import DECODER
from ..distributed import ranks
from ..errors import BatchError, ConfigError
from ..losses.objective import (
    IGNORE_INDEX,
    counted_positions,
    label_rule,
    labels_as_tensor,
    target_rules,
)
from ..model.headed import HeadedModel
from ..model.labels import keep_model_columns, route_labels
from . import shards
from .storage import CachedFeatures, _DiskWriter, _MemoryWriter, _Writer


def cache_features(
    model: HeadedModel,
    dataset: Any,
    batch_size: int = 32,
    collate_fn: Any = None,
    storage: str | PathLike = "memory",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    overwrite: bool = False,
    gather: bool = True,
) -> CachedFeatures:
    """Run the frozen backbone over ``dataset`` once and keep every head's input and labels.

    ``dataset``: a map-style or iterable dataset of examples (batched in order with
    ``batch_size`` and ``collate_fn``, default ``HeadedCollator(model)``) or a ``DataLoader``;
    batches hold model inputs and head targets, as for ``HeadedModel.forward`` (other
    columns are dropped with a warning naming them, as Trainer does).
    ``storage``: "memory" or a directory (created; an existing non-empty one needs
    ``overwrite=True``). ``dtype`` is the stored float type. Raises ConfigError if anything
    outside the heads is trainable (cached features would go stale as it trains).

    Under a process group of several ranks (torchrun, ``accelerate launch``; a launched
    process initialises it, see ``headkit.distributed.ranks``) the work is split: each rank runs a
    contiguous run of whole batches, the same batches one process would run (see
    ``headkit.features.shards``), and every rank gets the whole cache, rows in the dataset's
    order and equal to a single-process run: all-gathered in memory (``gather=False``: each
    rank keeps only its own rows, ``meta["shard"]`` says which), or one folder written
    together (every rank must see it) with one manifest written by rank 0.
    """
    check_frozen(model)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype={dtype!r} is invalid; a floating torch dtype (torch.float32...)")
    if not isinstance(gather, bool):
        raise ConfigError(
            f"gather={gather!r} is invalid; True (every rank gets the whole cache) "
            "or False (each rank its own rows)"
        )
    if not gather and not (isinstance(storage, str) and storage == "memory"):
        raise ConfigError(
            "gather=False applies to storage='memory'; a folder always holds the whole cache "
            "(every rank opens it memory-mapped)"
        )
    rank, world = ranks.current()
    loader = _loader(model, dataset, batch_size, collate_fn, rank, world)
    heads = _plan_heads(model)
    targets = _label_layouts(model)
    need_tokens = any(info["layout"] == "tokens" for info in heads.values()) or any(
        layout == "token" for layout in targets.values()
    )

    backbone = _backbone_meta(model)

    def meta_of(present: set[str], num_sequences: int, num_tokens: int) -> dict[str, Any]:
        return _meta(heads, targets, backbone, dtype, present, num_sequences, num_tokens)

    writer = _writer(storage, overwrite, rank, world)
    was_training = model.backbone.training
    model.backbone.eval()
    try:

        def pass_fn() -> tuple[set[str] | None, list[int]]:
            return _run_pass(model, loader, heads, targets, writer, dtype, progress and rank == 0)

        if world > 1:
            return shards.combine(writer, pass_fn, meta_of, need_tokens, gather, rank)
        present, lengths = pass_fn()
        if present is None:
            raise BatchError("the dataset is empty: there is nothing to cache")
        offsets = torch.tensor([0, *lengths], dtype=torch.long).cumsum(0)
        if need_tokens:
            writer.append("offsets", offsets)
        num_tokens = int(offsets[-1]) if need_tokens else 0
        return writer.finish(meta_of(present, len(lengths), num_tokens))
    except BaseException:
        writer.abort()
        raise
    finally:
        model.backbone.train(was_training)


def features_given(
    model: HeadedModel,
    dataset: Any,
    pooled: dict[str, torch.Tensor],
    batch_size: int = 32,
    collate_fn: Any = None,
) -> CachedFeatures:
    """The in-memory cache ``cache_features`` would build, from pooled features a caller
    already has, without running the backbone: ``pooled`` {head: (len(dataset), width)}, one
    row per example of ``dataset`` in order (e.g. a probe sweep's ``results.features``, which
    come from the same backbone and pooling); the labels are read from ``dataset`` as
    ``cache_features`` reads them. Every head must be a sequence head whose pooling has no
    trainable parameters (ConfigError otherwise, and for a missing head or a wrong shape)."""
    check_frozen(model)
    heads = _plan_heads(model)
    targets = _label_layouts(model)
    for name, info in heads.items():
        x = pooled.get(name)
        width = model.heads[name].in_features
        if info["layout"] != "pooled" or any(t == "token" for t in targets.values()):
            raise ConfigError(
                f"head {name!r} reads token states; features_given takes pooled features of "
                "sequence heads only (use cache_features)"
            )
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != len(dataset):
            got = "missing" if not isinstance(x, torch.Tensor) else f"shape {tuple(x.shape)}"
            raise ConfigError(
                f"pooled[{name!r}] is {got}; expected ({len(dataset)}, width): one row per "
                f"example (heads: {sorted(heads)})",
                field="pooled",
                value=name,
            )
        if x.shape[1] != width:
            raise ConfigError(
                f"pooled[{name!r}] has width {x.shape[1]}; head {name!r} reads {width}",
                field="pooled",
                value=name,
            )
    writer = _MemoryWriter()
    present: set[str] | None = None
    for batch in _loader(model, dataset, batch_size, collate_fn, 0, 1):
        _, labels = _split_batch(model, batch)
        for target, y in labels.items():
            writer.append(f"labels/{target}", labels_as_tensor(y, "cpu", f"target {target!r}"))
        present = set(labels) if present is None else present & set(labels)
    written: set[str] = set()
    for name, info in heads.items():
        if info["features"] not in written:  # heads on one layer and pooling share an array
            written.add(info["features"])
            writer.append(f"features/{info['features']}", pooled[name].detach().float())
    backbone = _backbone_meta(model)
    return writer.finish(
        _meta(heads, targets, backbone, torch.float32, present or set(), len(dataset), 0)
    )


def _meta(
    heads: dict[str, dict[str, Any]],
    targets: dict[str, str],
    backbone: dict[str, Any],
    dtype: torch.dtype,
    present: set[str],
    num_sequences: int,
    num_tokens: int,
) -> dict[str, Any]:
    """A cache's ``meta``: what it holds for which heads, labels and backbone."""
    return {
        "num_sequences": num_sequences,
        "num_tokens": num_tokens,
        "dtype": str(dtype).removeprefix("torch."),
        "heads": heads,
        "feature_keys": {info["features"]: info["layout"] for info in heads.values()},
        "labels": {t: {"layout": targets[t]} for t in sorted(present)},
        "backbone": backbone,
    }


def _writer(storage: Any, overwrite: bool, rank: int, world: int) -> _Writer:
    """Where the arrays go: memory, a folder, or this rank's part of a shared folder."""
    if isinstance(storage, str) and storage == "memory":
        return _MemoryWriter()
    if not isinstance(storage, (str, PathLike)):
        raise ConfigError(f"storage={storage!r} is invalid; 'memory' or a directory path")
    if world > 1:
        return shards.rank_writer(Path(storage), overwrite, rank)
    return _DiskWriter(Path(storage), overwrite)


def _run_pass(
    model: HeadedModel,
    loader: Iterable,
    heads: dict[str, dict[str, Any]],
    targets: dict[str, str],
    writer: _Writer,
    dtype: torch.dtype,
    progress: bool,
) -> tuple[set[str] | None, list[int]]:
    """Cache every batch of ``loader``; return the targets every batch had labels for (None
    without batches) and the real tokens of each sequence."""
    try:
        total = len(loader)  # type: ignore[arg-type]
    except TypeError:
        total = None
    lengths: list[int] = []
    present: set[str] | None = None
    bar = tqdm(
        loader, total=total, disable=not progress, desc="headkit: caching features", unit="batch"
    )
    with torch.no_grad():
        for i, batch in enumerate(bar):
            labels, batch_lengths = _cache_batch(model, heads, targets, batch, writer, dtype)
            if present is None:
                present = set(labels)
            elif set(labels) != present:
                raise BatchError(
                    f"batch {i} has labels for targets {sorted(labels)} but earlier batches "
                    f"had {sorted(present)}; every batch needs the same targets"
                )
            lengths += batch_lengths
    return present, lengths


def _loader(
    model: HeadedModel, dataset: Any, batch_size: Any, collate_fn: Any, rank: int, world: int
) -> Iterable:
    """A DataLoader as given, else one over ``dataset`` without the columns the model
    ignores; on several ranks, this rank's batches of it."""
    if not isinstance(dataset, DataLoader):
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ConfigError(f"batch_size={batch_size!r} is invalid; an integer >= 1")
        if collate_fn is None:
            from ..data.collator import HeadedCollator

            collate_fn = HeadedCollator(model)
        own = model.info.extra_inputs  # the backbone's own inputs beyond the usual ones
        dataset = keep_model_columns(dataset, model.head_configs, "cache_features", own)
        if world == 1:
            return DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate_fn)
    elif world == 1:
        return dataset
    return shards.loader_of_rank(dataset, batch_size, collate_fn, rank, world)


def _cache_batch(
    model: HeadedModel,
    heads: dict[str, dict[str, Any]],
    targets: dict[str, str],
    batch: Any,
    writer: _Writer,
    dtype: torch.dtype,
) -> tuple[set[str], list[int]]:
    """Run the backbone on one batch and append its features and labels; (targets, lengths)."""
    inputs, labels = _split_batch(model, batch)
    mask = inputs.mask
    masks = model.head_masks(inputs)  # per head: its stack's positions, pool_over
    keys = model.state_keys()
    wanted = {keys[name] for name in heads}
    captured, _ = run_stage(model.backbone, model.info, inputs, wanted, model.early_exit)
    # (batch, seq, hidden): an encoder state where one was read (only decoder heads: a decoder's)
    ref = next((v for k, v in captured.items() if not k.on_decoder), None)
    ref = next(iter(captured.values())) if ref is None else ref
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
        hidden = captured[keys[name]]
        if info["layout"] == "pooled":
            x = model.heads[name].features(hidden, masks[name])  # (batch, width)
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
    hooks = model.state_keys()
    plan = {}
    for name, head in model.heads.items():
        cfg = model.head_configs[name]
        layer = hooks[name]
        if layer.on_decoder and not cfg.pred_for_sequence:
            raise ConfigError(
                f"head {name!r} reads the decoder per position; cached features keep the "
                "encoder's positions: cache sequence heads of the decoder, or train it through "
                "HeadedModel.forward"
            )
        place = f"{'D' if layer.on_decoder else 'L'}{layer.index}"
        if cfg.pool_over != "all":
            place += f".{cfg.pool_over}"
        trainable_pool = head.pooling is not None and any(
            p.requires_grad for p in head.pooling.parameters()
        )
        if cfg.pred_for_sequence and not trainable_pool:
            layout, key = "pooled", f"{place}.{cfg.pooling}"
        else:
            layout, key = "tokens", f"{place}.tokens"
        plan[name] = {
            "layout": layout,
            "features": key,
            "layer": [DECODER, layer.index] if layer.on_decoder else layer.index,  # JSON
            "pred_for_sequence": cfg.pred_for_sequence,
            "pooling": cfg.pooling,
        }
    return plan


def _label_layouts(model: HeadedModel) -> dict[str, str]:
    """Each target's layout (the label rule): "sequence" (one label row per sequence) or
    "token" (one per position)."""
    return {t: rule.layout for t, rule in target_rules(model.head_configs).items()}


def _split_batch(model: HeadedModel, batch: Any) -> tuple[Any, dict[str, Any]]:
    """Backbone inputs (prepared and checked as ``HeadedModel.forward`` does) and labels."""
    if not isinstance(batch, dict) and hasattr(batch, "keys"):
        batch = dict(batch)  # BatchEncoding, UserDict
    if not isinstance(batch, dict):
        raise BatchError(
            f"a batch must be a dict of model inputs and head targets, got {type(batch).__name__}"
        )
    targets = {c.target for c in model.head_configs.values()}
    batch = drop_tokenizer_extras(batch, targets)
    allowed = batch_inputs(model.info)
    unknown = sorted(k for k in batch if k not in targets | {"labels"} and k not in allowed)
    if unknown:
        raise BatchError(
            f"unexpected batch key(s) {unknown} while caching features; allowed: model inputs "
            f"{list(allowed)} and head targets {sorted(targets)}"
        )
    device = model.device
    given = {
        k: (v.to(device) if isinstance(v, torch.Tensor) else v)
        for k, v in batch.items()
        if k in allowed and v is not None
    }
    inputs = prepare_inputs(model.backbone, model.info, given, check=model.check_inputs)
    given = {k: v for k, v in batch.items() if k not in allowed}
    labels = {k: v for k, v in route_labels(model.head_configs, given).items() if v is not None}
    return inputs, labels


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
        rule = label_rule(cfg)
        if cfg.target != target or cfg.loss_fct is None or rule.layout != "token":
            continue
        # The loss's own rule, applied to the padding pattern: where predictions and labels
        # meet (shifted for causal-LM heads) and which positions count.
        pred_pad, label_pad, counts = counted_positions(cfg, pad.unsqueeze(-1), pad, real)
        _, y, _ = counted_positions(cfg, pad.unsqueeze(-1), labels, real)
        if rule.ignore_index is not None:
            kept = y != rule.ignore_index
            counts = counts & (kept.any(-1) if kept.dim() > 2 else kept)
        if bool((counts & (pred_pad.squeeze(-1) | label_pad)).any()):
            raise BatchError(
                f"head {name!r} (target {target!r}): padding positions count in its loss "
                f"(ignore_pads={cfg.ignore_pads}, labels at padding are not {IGNORE_INDEX}), "
                "but cached features keep real tokens only; set the labels at padding to "
                f"{IGNORE_INDEX} or ignore_pads=True"
            )


def _backbone_meta(model: HeadedModel, fingerprint: bool = True) -> dict[str, Any]:
    """What the cache records of the backbone: class, sizes and (``fingerprint``) its
    ``tensors_fingerprint``, which tells another backbone of the same shape apart."""
    meta = {
        "class": type(model.backbone).__name__,
        "name_or_path": str(getattr(model.config, "name_or_path", "") or ""),
        "num_layers": model.info.num_layers,
        "hidden_size": model.info.hidden_size,
    }
    if fingerprint:
        meta["fingerprint"] = tensors_fingerprint(model.backbone)
    return meta
