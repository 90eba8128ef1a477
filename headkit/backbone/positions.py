"""Position ids from the attention mask, and the backbone's position limits.

A row must give the same predictions whatever side it is padded on, and a mask with a gap
("hole") between real tokens must either give the predictions of the row without the gap or
be refused. Attention already ignores padded keys; what differs is the position each real
token gets. So, when the caller passes no ``position_ids``, they are derived from the mask:

* real tokens are numbered 0, 1, ... in mask order, skipping padding and gaps, for decoders
  (as ``generate`` does) and encoders alike; padded positions get their own index (encoders,
  so a right-padded batch gets exactly the model's default positions) or the last real
  position (decoders, as ``generate`` does);
* RoBERTa-style models (their embeddings build positions from ``padding_idx``) number real
  tokens from ``padding_idx + 1`` and give padding ``padding_idx``, as they do themselves;
* a backbone whose ``forward`` takes no ``position_ids`` cannot be helped: a mask with a gap is
  a ``BatchError``; left padding is accepted, with a warning once per backbone when the model
  has an absolute position table (its left-padded rows may differ from right-padded ones).
  Without such a table (ALiBi, relative attention) positions are relative: shift-invariant.

The positions are then checked against the absolute position table, if the backbone has one
(``max_position_embeddings`` / ``n_positions`` rows), before the backbone runs.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import BatchError

#: Names of absolute position tables in transformers models (BERT/RoBERTa/DistilBERT, GPT-2, OPT).
POSITION_TABLES = ("position_embeddings", "wpe", "embed_positions", "position_embedding")

_WARNED: weakref.WeakSet = weakref.WeakSet()  # backbones already warned about left padding


@dataclass(frozen=True)
class PositionScheme:
    """How a backbone numbers positions, found by inspection (``position_scheme``).

    ``rows``: rows of its absolute position table (None: no table, e.g. rotary or ALiBi).
    ``internal_offset``: what the model adds to the ids it is given (OPT: 2).
    ``first``: the id of the first real token (0; RoBERTa-style: ``padding_idx + 1``).
    ``pad``: the id RoBERTa-style models give padding (``padding_idx``), else None.
    """

    model_name: str
    takes_ids: bool
    rows: int | None = None
    internal_offset: int = 0
    first: int = 0
    pad: int | None = None
    limit: str = ""

    @property
    def max_id(self) -> int | None:
        """The largest position id the table accepts (None: no table)."""
        return None if self.rows is None else self.rows - self.internal_offset - 1

    @property
    def max_length(self) -> int | None:
        """The most positions (cached + new) a sequence may have (None: no table)."""
        return None if self.rows is None else self.max_id - self.first + 1


def position_scheme(backbone: nn.Module, forward_params: set[str]) -> PositionScheme:
    """Inspect ``backbone`` (a bare transformer) for its position table and numbering."""
    table_name, table = _position_table(backbone)
    cfg = getattr(backbone, "config", None)
    scheme = PositionScheme(type(backbone).__name__, "position_ids" in forward_params)
    if table is None:
        return scheme
    limit = next(
        (
            f"{n}={getattr(cfg, n)}"
            for n in ("max_position_embeddings", "n_positions")
            if isinstance(getattr(cfg, n, None), int)
        ),
        f"{table_name}: {table.num_embeddings} rows",
    )
    parent = backbone.get_submodule(table_name.rpartition(".")[0]) if "." in table_name else None
    padding_idx = getattr(parent, "padding_idx", None)
    roberta_style = isinstance(padding_idx, int) and any(
        hasattr(parent, m)
        for m in ("create_position_ids_from_input_ids", "create_position_ids_from_inputs_embeds")
    )
    offset = getattr(table, "offset", 0)
    return PositionScheme(
        scheme.model_name,
        scheme.takes_ids,
        rows=table.num_embeddings,
        internal_offset=offset if isinstance(offset, int) else 0,
        first=padding_idx + 1 if roberta_style else 0,
        pad=padding_idx if roberta_style else None,
        limit=limit,
    )


def _position_table(backbone: nn.Module) -> tuple[str, nn.Embedding | None]:
    """The shallowest ``nn.Embedding`` named like an absolute position table."""
    found = [
        (name, m)
        for name, m in backbone.named_modules()
        if isinstance(m, nn.Embedding) and name.rpartition(".")[2] in POSITION_TABLES
    ]
    if not found:
        return "", None
    return min(found, key=lambda nm: nm[0].count("."))


def mask_position_ids(
    backbone: nn.Module,
    scheme: PositionScheme,
    is_decoder: bool,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    seq: int,
    check: bool = True,
) -> torch.Tensor | None:
    """The position ids to pass: the caller's, else derived from the mask (module docstring).

    ``attention_mask`` may cover ``past + seq`` positions (cached decoding): the ids of the
    last ``seq`` are returned. None when the backbone keeps its own default.
    """
    if position_ids is not None or attention_mask is None:
        return position_ids
    if not scheme.takes_ids:
        if check:
            _refuse_gaps_warn_left(backbone, scheme, attention_mask)
        return None
    real = attention_mask.bool()
    count = real.long().cumsum(-1)  # (batch, past + seq)
    if scheme.pad is not None:  # RoBERTa-style: padding_idx + 1, ... ; padding: padding_idx
        pos = torch.where(real, count - 1 + scheme.first, scheme.pad)
    elif is_decoder:  # as generate() does: padding repeats the last real position
        pos = (count - 1).clamp(min=0)
    else:  # padding keeps its own index: a right-padded row gets the default 0..n-1 exactly
        index = torch.arange(real.shape[1], device=real.device).expand_as(count)
        pos = torch.where(real, count - 1, index)
    return pos[:, -seq:]


def _refuse_gaps_warn_left(
    backbone: nn.Module, scheme: PositionScheme, attention_mask: torch.Tensor
) -> None:
    """For backbones without ``position_ids``: a gap is an error, left padding a warning."""
    real = attention_mask.bool()
    n = real.shape[1]
    index = torch.arange(n, device=real.device)
    count = real.sum(-1)
    first = torch.where(real, index, n).amin(-1)
    last = torch.where(real, index, -1).amax(-1)
    gaps = (count > 0) & (last - first + 1 != count)
    if bool(gaps.any()):
        row = int(gaps.nonzero()[0, 0])
        raise BatchError(
            f"attention_mask row {row} ({real[row].long().tolist()}) has padding between real "
            f"tokens; {scheme.model_name} takes no position_ids, so headkit cannot number the "
            "tokens after the gap as if it were not there: remove the gap (real tokens "
            "contiguous, padding on one side)"
        )
    left = (count > 0) & (first > 0)
    if scheme.rows is not None and bool(left.any()) and backbone not in _WARNED:
        _WARNED.add(backbone)
        warnings.warn(
            f"{scheme.model_name} takes no position_ids: its left-padded rows get positions "
            "counted from the padding, so their predictions may differ from the same rows "
            "padded on the right; pad on the right for this model (warned once per model)",
            stacklevel=4,
        )


def check_position_range(
    scheme: PositionScheme,
    position_ids: torch.Tensor | None,
    given: bool,
    seq: int,
    past: int,
    shape: tuple[int, ...],
) -> None:
    """Refuse positions outside the backbone's absolute position table before it runs.

    ``position_ids`` are those that will be passed (``given`` by the caller, or derived from
    the mask); None means the backbone's default (``first .. first + past + seq - 1``).
    """
    hi_allowed = scheme.max_id
    if hi_allowed is None:
        return
    if position_ids is None:
        lo, hi = scheme.first, scheme.first + past + seq - 1
    elif position_ids.device.type == "meta" or position_ids.numel() == 0:
        return
    else:
        lo, hi = int(position_ids.min()), int(position_ids.max())
    if lo >= 0 and hi <= hi_allowed:
        return
    bad = lo if lo < 0 else hi
    if given:
        where = f"position_ids holds {bad}"
    elif position_ids is not None:
        where = f"the attention_mask numbers a token {bad}"
    else:
        where = f"the sequence reaches position {bad}"
    cached = f" with {past} cached positions" if past else ""
    raise BatchError(
        f"{where}, outside the position table of {scheme.model_name} ({scheme.limit}), "
        f"which would have rejected an index; input shape {shape}{cached}: a sequence may "
        f"have at most {scheme.max_length} positions and position_ids must lie in "
        f"0..{hi_allowed}"
    )


def check_token_type_range(backbone: nn.Module, token_type_ids: torch.Tensor | None) -> None:
    """Refuse token type ids outside the backbone's token type table (``type_vocab_size``)."""
    if token_type_ids is None or token_type_ids.device.type == "meta":
        return
    rows = getattr(getattr(backbone, "config", None), "type_vocab_size", None)
    if not isinstance(rows, int) or token_type_ids.numel() == 0:
        return
    lo, hi = int(token_type_ids.min()), int(token_type_ids.max())
    if lo < 0 or hi >= rows:
        raise BatchError(
            f"token_type_ids holds {lo if lo < 0 else hi}, outside the token type table of "
            f"{type(backbone).__name__}; allowed: 0..{rows - 1} (type_vocab_size={rows})"
        )
