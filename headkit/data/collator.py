"""HeadedCollator: pad a list of examples into one batch for a HeadedModel.

Inputs are padded with the pad id and a 0 in ``attention_mask`` (headkit reads padding from
the mask only). Token-level labels are padded on the same side as the inputs with -100 (or a
per-target pad value); sequence-level labels are stacked (ints → int64, floats → float32).
Labels go under ``batch["labels"]`` as ``{target: tensor}``: HF Trainer recognises that key as
the batch's labels (so evaluation reports ``eval_loss``) and HeadedModel unpacks it. For a
model with one head that has a loss, ``batch["labels"]`` is that head's label tensor, as
transformers' collators make it (so Trainer's ``EvalPrediction.label_ids`` is a plain array),
and a ``label`` / ``label_ids`` column is that head's label too.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..backbone.inputs import TOKEN_INPUT_PADS as _TOKEN_INPUTS
from ..backbone.modalities import frame_lengths
from ..errors import BatchError, ConfigError
from ..losses.objective import IGNORE_INDEX, TargetRule, target_rules
from ..model.labels import RENAMED_TO_LABELS, single_loss_target
from .signals import collate_signals, signal_keys


class HeadedCollator:
    """Collate feature dicts (``input_ids`` lists, optional ``attention_mask``, labels by target).

    ``model`` (a HeadedModel) tells which targets are token-level (its heads' label rule,
    ``losses.objective.target_rules``); for targets it does not read, ``token_targets`` lists
    token-level ones, and otherwise a label is token-level when every example's label has as
    many entries as its ``input_ids``. The pad id is ``pad_token_id``, else the tokenizer's pad (or
    eos) id, else the model config's, else 0: its value never matters to headkit, which reads
    padding from ``attention_mask``. ``padding_side`` defaults to the tokenizer's, else "right".
    ``label_pad_value`` pads token-level labels (per target with a dict; default -100) and
    fills labels missing from some examples. ``labels_key=None`` puts targets at the top level.

    Images, audio and decoder inputs (the backbone's inputs beyond the token ones:
    ``pixel_values``, ``input_values``, ``input_features``, ``decoder_input_ids``, ...) are
    stacked or padded as ``data/signals.py`` says; an example of an image or audio model needs
    no ``input_ids``. A frame (token) head of a speech model takes one label per frame of the
    example's real audio (the model's own count, ``_get_feat_extract_output_lengths``),
    padded on the right, as the audio is, to the batch's frames.
    """

    def __init__(
        self,
        model: Any = None,
        tokenizer: Any = None,
        *,
        pad_token_id: int | None = None,
        padding_side: str | None = None,
        label_pad_value: float | Mapping[str, float] = IGNORE_INDEX,
        token_targets: Iterable[str] | None = None,
        pad_to_multiple_of: int | None = None,
        labels_key: str | None = "labels",
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        side = padding_side or getattr(tokenizer, "padding_side", None) or "right"
        if side not in ("left", "right"):
            raise ConfigError(
                f"HeadedCollator: padding_side={side!r} is invalid; 'left' or 'right'"
            )
        self.padding_side = side
        self.pad_token_id = _pick_pad_id(pad_token_id, tokenizer, model)
        if pad_to_multiple_of is not None and (
            not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1
        ):
            raise ConfigError(
                f"HeadedCollator: pad_to_multiple_of={pad_to_multiple_of!r} is invalid; an "
                "integer >= 1 or None"
            )
        self.pad_to_multiple_of = pad_to_multiple_of
        self.label_pad_value = _checked_pad_values(label_pad_value)
        if labels_key is not None and (not isinstance(labels_key, str) or not labels_key):
            raise ConfigError(
                f"HeadedCollator: labels_key={labels_key!r} is invalid; a non-empty string "
                "(default 'labels') or None (targets at the top level)"
            )
        self.labels_key = labels_key
        if isinstance(token_targets, (str, bytes)):
            raise ConfigError(
                f"HeadedCollator: token_targets={token_targets!r} is invalid; a list of target "
                f"names (e.g. [{token_targets!r}]), not one string"
            )
        self._signals = signal_keys(model)
        self._configs = _head_configs(model)
        self._rules: dict[str, TargetRule] = target_rules(self._configs)  # the label rule
        self._single_target = single_loss_target(self._configs) if self._configs else None
        self._token_targets = set(token_targets or ())
        per_example = sorted(
            t for t in self._token_targets if t in self._rules and self._rules[t].layout != "token"
        )
        if per_example:
            raise ConfigError(
                f"HeadedCollator: token_targets names {per_example}, which the model's heads read "
                "as one label per example (pred_for_sequence=True); leave them out"
            )

    # ------------------------------------------------------------------ public
    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Pad and stack ``features`` into a batch of tensors."""
        if not isinstance(features, Sequence) or isinstance(features, (str, bytes)):
            hint = " (one example? wrap it in a list)" if isinstance(features, Mapping) else ""
            raise BatchError(
                f"HeadedCollator: features must be a list of feature dicts, got "
                f"{type(features).__name__}{hint}; pass list(...) of the examples"
            )
        if not features:
            raise BatchError("HeadedCollator: got an empty list of features; expected >= 1")
        for i, f in enumerate(features):
            if not isinstance(f, Mapping):
                raise BatchError(
                    f"HeadedCollator: feature {i} is a {type(f).__name__}; expected a dict"
                )
        signals = any(f.get(k) is not None for f in features for k in self._signals)
        if not signals and not any("input_ids" in f for f in features):  # else: _token_inputs
            raise BatchError(
                f"HeadedCollator: feature 0 has no 'input_ids' (keys: {sorted(features[0])})"
            )
        batch, lengths, width = self._token_inputs(features)
        pad = functools.partial(self._pad, width=width)  # rows, value → padded like input_ids
        batch.update(collate_signals(features, self._signals, self.pad_token_id, lengths, pad))
        keys = [k for k in dict.fromkeys(k for f in features for k in f) if k not in _TOKEN_INPUTS]
        keys = [k for k in keys if k not in self._signals]
        side = None  # token labels padded as input_ids are
        if lengths is None:  # images or audio: per example, or per frame of the audio
            token = [k for k in keys if self._target_of(k, keys) in self._rules]
            token = [k for k in token if self._rules[self._target_of(k, keys)].layout == "token"]
            frames = self._frames(batch) if token else None
            if token and frames is None:
                raise BatchError(
                    f"HeadedCollator: target {token[0]!r} is read per position, but these "
                    "examples have neither input_ids nor audio (input_values) of a speech model "
                    "to align it with; an image gets one label (pred_for_sequence=True)"
                )
            lengths, width = frames or ([-1] * len(features), 0)
            side = "right"  # audio is padded on the right, and so are its frames

        labels: dict[str, torch.Tensor] = {}
        for key in keys:
            target = self._target_of(key, keys)
            values = [f.get(key) for f in features]
            if all(v is None for v in values):
                continue
            labels[target] = self._collate_labels(target, values, lengths, width, side)
        single = self._single_target
        if single in labels and self.labels_key == "labels":
            batch["labels"] = labels.pop(single)  # one trained head: a plain tensor
            batch.update(labels)
        elif labels:
            if self.labels_key is None:
                batch.update(labels)
            else:
                batch[self.labels_key] = labels
        return batch

    def is_token_level(self, target: str, values: Sequence[Any], lengths: Sequence[int]) -> bool:
        """Whether ``target`` holds one label per token: the model's label rule says, else
        ``token_targets``, else every example's label has one entry per token."""
        if target in self._rules:
            return self._rules[target].layout == "token"
        if target in self._token_targets:
            return True
        present = [(v, n) for v, n in zip(values, lengths) if v is not None]
        return all(_label_len(v) == n for v, n in present) and any(
            _label_len(v) is not None for v, _ in present
        )

    # ------------------------------------------------------------------ helpers
    def _token_inputs(
        self, features: Sequence[Mapping[str, Any]]
    ) -> tuple[dict[str, Any], list[int] | None, int]:
        """(the padded token inputs, each example's length, the padded width); ({}, None, 0)
        for examples without ``input_ids`` (images, audio)."""
        if not any("input_ids" in f for f in features):
            return {}, None, 0
        missing = [i for i, f in enumerate(features) if "input_ids" not in f]
        if missing:
            raise BatchError(
                f"HeadedCollator: feature {missing[0]} has no 'input_ids' (keys: "
                f"{sorted(features[missing[0]])})"
            )
        ids = [_as_1d(f["input_ids"], "input_ids", i) for i, f in enumerate(features)]
        lengths = [len(x) for x in ids]
        width = max(lengths)
        if self.pad_to_multiple_of:
            m = self.pad_to_multiple_of
            width = -(-width // m) * m
        batch: dict[str, Any] = {"input_ids": self._pad(ids, self.pad_token_id, width)}
        masks = _token_rows(features, lengths, "attention_mask", fill=1)
        batch["attention_mask"] = self._pad(masks, 0, width)
        for key in ("token_type_ids", "position_ids"):
            if any(f.get(key) is not None for f in features):
                rows = _token_rows(features, lengths, key, fill=0)
                batch[key] = self._pad(rows, _TOKEN_INPUTS[key], width)
        return batch, lengths, width

    def _target_of(self, key: str, keys: list[str]) -> str:
        """The head target a feature key holds: itself, or for a model with one head that
        has a loss, a ``label`` / ``label_ids`` / ``labels`` column is that head's label."""
        if self.model is None or key in self._rules:
            return key
        renamed = key in (*RENAMED_TO_LABELS, "labels")
        if renamed and self._single_target is not None:
            if self._single_target in keys:
                raise BatchError(
                    f"HeadedCollator: features hold both {key!r} and {self._single_target!r}, "
                    f"the labels of the model's one head with a loss; keep one of them"
                )
            return self._single_target
        hint = (
            "; a 'label' column goes to the head with a loss only when the model has exactly "
            "one: name the column after its head's target"
            if renamed
            else ""
        )
        raise BatchError(
            f"HeadedCollator: feature key {key!r} is neither a model input "
            f"({', '.join(_TOKEN_INPUTS)}) nor a head target "
            f"({', '.join(sorted(self._rules))}); remove that column from the data{hint}"
        )

    def _pad_value(self, target: str) -> float:
        v = self.label_pad_value
        return v.get(target, IGNORE_INDEX) if isinstance(v, Mapping) else v

    def _frames(self, batch: Mapping[str, Any]) -> tuple[list[int], int] | None:
        """(each example's frames, the batch's frames) for audio of a speech model: a frame
        (token) head's labels have one entry per frame of the example's real audio."""
        if self.model is None or "input_values" not in batch:
            return None
        backbone = getattr(self.model, "backbone", self.model)
        samples = batch["input_values"].shape[1]
        return frame_lengths(backbone, batch["attention_mask"].sum(-1), samples)

    def _pad(
        self, rows: list[torch.Tensor], value: float, width: int, side: str | None = None
    ) -> torch.Tensor:
        """Stack rows of shape (len_i, *rest) into (batch, width, *rest), padding on one side
        (``side``, else the collator's ``padding_side``)."""
        rest = tuple(rows[0].shape[1:])
        dtype = _common_dtype(rows)
        out = torch.full((len(rows), width, *rest), value, dtype=dtype)
        for i, r in enumerate(rows):
            n = r.shape[0]
            if (side or self.padding_side) == "right":
                out[i, :n] = r
            elif n:
                out[i, width - n :] = r
        return out

    def _collate_labels(
        self, target: str, values: list[Any], lengths: list[int], width: int, side: str | None
    ) -> torch.Tensor:
        pad = self._pad_value(target)
        missing = [i for i, v in enumerate(values) if v is None]
        if missing:
            self._check_fillable(target, missing[0])
        if self.is_token_level(target, values, lengths):
            rows: list[torch.Tensor | None] = []
            for i, (v, n) in enumerate(zip(values, lengths)):
                if v is None:
                    rows.append(None)
                    continue
                t = _label_tensor(v, target, i)
                if t.dim() == 0 or t.shape[0] != n:
                    got = "a scalar" if t.dim() == 0 else f"{t.shape[0]} entries"
                    has = f"its audio has {n} frames" if side else f"its input_ids have {n} tokens"
                    per = "frame of real audio" if side else "token"
                    raise BatchError(
                        f"HeadedCollator: token-level target {target!r} of feature {i} has "
                        f"{got}, but {has}; expected one label per {per}"
                    )
                rows.append(t)
            known = [r for r in rows if r is not None]
            rest = _same_trailing_shape(known, target)
            dtype = _label_dtype(known, pad)
            filled = [
                r if r is not None else torch.full((n, *rest), pad, dtype=dtype)
                for r, n in zip(rows, lengths)
            ]
            return self._pad([r.to(dtype) for r in filled], pad, width, side)
        tensors = [None if v is None else _label_tensor(v, target, i) for i, v in enumerate(values)]
        known = [t for t in tensors if t is not None]
        shape = tuple(known[0].shape)
        for i, t in enumerate(tensors):
            if t is not None and tuple(t.shape) != shape:
                raise BatchError(
                    f"HeadedCollator: target {target!r} of feature {i} has shape "
                    f"{tuple(t.shape)}, but feature {tensors.index(known[0])} has {shape}; "
                    "sequence-level labels must all have one shape"
                )
        dtype = _label_dtype(known, pad)
        return torch.stack(
            [t.to(dtype) if t is not None else torch.full(shape, pad, dtype=dtype) for t in tensors]
        )

    def _check_fillable(self, target: str, index: int) -> None:
        """Missing labels become the pad value; refuse where the head's loss would count it."""
        pad = self._pad_value(target)
        rule = self._rules.get(target)
        if rule is None or pad != IGNORE_INDEX:
            return
        for name, head_rule in rule.heads.items():
            if head_rule.ignore_index is None:
                cfg = self._configs[name]
                raise BatchError(
                    f"HeadedCollator: feature {index} has no {target!r} label, and head "
                    f"{name!r} (loss_fct={cfg.loss_fct!r}) would train on the fill value "
                    f"{IGNORE_INDEX}; give every example this label or use a loss that ignores "
                    "-100 (e.g. 'masked_mse')"
                )


# ---------------------------------------------------------------------- module helpers
def _token_rows(
    features: list[Mapping[str, Any]], lengths: list[int], key: str, fill: int
) -> list[torch.Tensor]:
    """Each feature's per-token ``key`` (``fill`` where absent), checked against its length."""
    rows = []
    for i, (f, n) in enumerate(zip(features, lengths)):
        row = _as_1d(f[key], key, i) if f.get(key) is not None else torch.full((n,), fill)
        if len(row) != n:
            raise BatchError(
                f"HeadedCollator: feature {i} has {key} of length {len(row)} but "
                f"input_ids of length {n}"
            )
        rows.append(row)
    return rows


def _pick_pad_id(pad_token_id: int | None, tokenizer: Any, model: Any) -> int:
    candidates = [
        pad_token_id,
        getattr(tokenizer, "pad_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "config", None), "pad_token_id", None),
        0,
    ]
    pid = next(c for c in candidates if c is not None)
    if isinstance(pid, (list, tuple)):
        pid = pid[0]
    if not isinstance(pid, numbers.Integral) or isinstance(pid, bool) or pid < 0:
        raise ConfigError(f"HeadedCollator: pad_token_id={pid!r} is invalid; a token id >= 0")
    return int(pid)


def _head_configs(model: Any) -> dict[str, Any]:
    if model is None:
        return {}
    configs = getattr(model, "head_configs", None)
    if not isinstance(configs, Mapping):
        raise ConfigError(
            f"HeadedCollator: model={type(model).__name__} is invalid; a HeadedModel or None"
        )
    return dict(configs)


def _checked_pad_values(value: Any) -> Any:
    """``label_pad_value``: a finite number, or a mapping of target → finite number."""
    items = value.items() if isinstance(value, Mapping) else [(None, value)]
    for target, v in items:
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            where = "" if target is None else f"[{target!r}]"
            raise ConfigError(
                f"HeadedCollator: label_pad_value{where}={v!r} is invalid; a finite number "
                f"(default {IGNORE_INDEX}: ignored by the losses), or a dict of them by target"
            )
    return value


def _as_1d(value: Any, field: str, index: int) -> torch.Tensor:
    where = f"HeadedCollator: feature {index} has {field}"
    if isinstance(value, (str, bytes)):
        raise BatchError(
            f"{where}={value!r:.60} ({type(value).__name__}); expected a 1-D list of integer "
            "token ids (tokenize the text first)"
        )
    if isinstance(value, torch.Tensor):
        t = value
    else:
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError) as e:  # ragged nesting
            raise BatchError(f"{where} that cannot become an array ({e})") from None
        if arr.size and arr.dtype.kind not in "biuf":
            raise BatchError(
                f"{where} holding {arr.dtype} values ({value!r:.60}); expected a 1-D list of "
                "integers"
            )
        t = torch.as_tensor(arr)
    if t.dim() == 1 and t.numel() == 0:
        raise BatchError(f"{where} empty ([]); expected at least one token id per example")
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise BatchError(
            f"HeadedCollator: feature {index} has {field} of shape {tuple(t.shape)} and dtype "
            f"{t.dtype}; expected a 1-D list of integers"
        )
    return t.long()


def _label_len(value: Any) -> int | None:
    if isinstance(value, torch.Tensor | np.ndarray):
        return int(value.shape[0]) if value.ndim >= 1 else None
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return len(value)
    return None


def _label_tensor(value: Any, target: str, index: int) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise BatchError(
            f"HeadedCollator: target {target!r} of feature {index} cannot become a tensor ({e})"
        ) from None
    if arr.dtype == object or arr.dtype.kind not in "biuf":
        raise BatchError(
            f"HeadedCollator: target {target!r} of feature {index} is {value!r}; expected numbers "
            "(or equal-length lists of numbers)"
        )
    return torch.from_numpy(arr.copy())


def _same_trailing_shape(rows: list[torch.Tensor], target: str) -> tuple[int, ...]:
    rest = tuple(rows[0].shape[1:])
    for r in rows:
        if tuple(r.shape[1:]) != rest:
            raise BatchError(
                f"HeadedCollator: token-level target {target!r} mixes label shapes "
                f"{tuple(rows[0].shape[1:])} and {tuple(r.shape[1:])} per token"
            )
    return rest


def _label_dtype(tensors: list[torch.Tensor], pad: float) -> torch.dtype:
    """int64 for integer (and bool-free integer) labels, float32 as soon as any is a float."""
    if any(t.dtype.is_floating_point for t in tensors) or float(pad) != int(pad):
        return torch.float32
    if all(t.dtype == torch.bool for t in tensors):
        return torch.float32  # binary targets for bce losses
    return torch.long


def _common_dtype(rows: list[torch.Tensor]) -> torch.dtype:
    dtype = rows[0].dtype
    for r in rows[1:]:
        dtype = torch.promote_types(dtype, r.dtype)
    return dtype
