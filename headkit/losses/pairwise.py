"""Pairwise (preference) objectives: how a pair travels in a batch, and the Bradley–Terry loss.

A reward head scores every row of the batch (one output per sequence). Its label says, per
row, what the row is in that head's preference pairs (``PAIR_LABELS``):

- ``1`` the chosen text of a pair, ``0`` the rejected one, ``-100`` a row this head does not
  read (another head's pair, or an example for another head);
- the k-th chosen row (in batch order) is paired with the k-th rejected row, so TRL's layout
  (every chosen row, then every rejected row) is ``[1] * n + [0] * n``, and batches that each
  hold whole pairs still pair correctly when concatenated (evaluation gathers them so);
- a label of shape (rows, 2) carries the pair's margin in its second column, read on the
  chosen row (TRL's ``margin`` column).

Several reward heads share one forward pass: each has its own target, so its own rows
(``helpful``: rows 0-3, ``harmless``: rows 4-7 of one batch), and a head's label is -100 on
the rows of the others. The loss is TRL ``RewardTrainer``'s:
``-logsigmoid(r_chosen - r_rejected - margin).mean()``, plus
``center_rewards_coefficient * mean((r_chosen + r_rejected) ** 2)`` when that is set.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..errors import BatchError

#: A row's value in a pairwise head's label: chosen, rejected, or not read by this head.
CHOSEN, REJECTED, NOT_READ = 1, 0, -100
PAIR_LABELS = (CHOSEN, REJECTED, NOT_READ)


def preference_labels(
    n_pairs: int,
    *,
    rows: int | None = None,
    start: int = 0,
    margins: Any = None,
) -> torch.Tensor:
    """The label of one reward head whose pairs sit at rows ``start .. start + 2 n_pairs``
    (chosen rows first, then rejected rows, as TRL batches them) of a batch of ``rows`` rows
    (default: just those); -100 elsewhere. With ``margins`` (n_pairs values) the label is
    (rows, 2), the margin on each chosen row."""
    rows = start + 2 * n_pairs if rows is None else rows
    if n_pairs < 0 or start < 0 or start + 2 * n_pairs > rows:
        raise BatchError(
            f"preference_labels: n_pairs={n_pairs}, start={start} do not fit rows={rows}; "
            "allowed: start + 2 * n_pairs <= rows"
        )
    roles = torch.full((rows,), float(NOT_READ))
    roles[start : start + n_pairs] = CHOSEN
    roles[start + n_pairs : start + 2 * n_pairs] = REJECTED
    if margins is None:
        return roles
    m = torch.as_tensor(margins, dtype=torch.float32).reshape(-1)
    if m.numel() != n_pairs:
        raise BatchError(
            f"preference_labels: {m.numel()} margins for n_pairs={n_pairs}; one per pair"
        )
    margin = torch.zeros(rows)
    margin[start : start + n_pairs] = m
    return torch.stack([roles, margin], dim=-1)


def split_pairs(
    labels: torch.Tensor, where: str = "pairwise head"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(chosen rows, rejected rows, margins or None)`` of a pairwise label (rows,) or
    (rows, 2): the k-th chosen row is paired with the k-th rejected row. A BatchError naming
    ``where`` for a value other than 1, 0 or -100, or unequal numbers of chosen and rejected."""
    if labels.dim() == 2 and labels.shape[-1] == 1:
        labels = labels[:, 0]
    if labels.dim() not in (1, 2) or (labels.dim() == 2 and labels.shape[-1] != 2):
        raise BatchError(
            f"{where}: a pairwise label of shape {tuple(labels.shape)} does not fit; expected "
            "(rows,) of 1 (chosen) / 0 (rejected) / -100, or (rows, 2) with the margin second"
        )
    roles = labels if labels.dim() == 1 else labels[:, 0]
    bad = (roles != CHOSEN) & (roles != REJECTED) & (roles != NOT_READ)
    if bool(bad.any()):
        raise BatchError(
            f"{where}: pairwise label value {float(roles[bad][0]):g} is invalid; allowed: "
            f"{CHOSEN} (chosen), {REJECTED} (rejected), {NOT_READ} (a row this head does not read)"
        )
    chosen = torch.nonzero(roles == CHOSEN).reshape(-1)
    rejected = torch.nonzero(roles == REJECTED).reshape(-1)
    if chosen.numel() != rejected.numel():
        raise BatchError(
            f"{where}: the batch has {chosen.numel()} chosen and {rejected.numel()} rejected "
            "rows; each chosen row needs its rejected row (the k-th chosen pairs with the "
            "k-th rejected)"
        )
    margin = None
    if labels.dim() == 2:
        margin = labels[chosen, 1]
        if not bool(torch.isfinite(margin).all()):
            raise BatchError(f"{where}: a pair's margin is NaN or infinite; margins are finite")
    return chosen, rejected, margin


def bradley_terry(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-pair Bradley–Terry loss ``-logsigmoid(chosen - rejected - margin)`` (pairs,)."""
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin.to(diff.dtype)
    return -F.logsigmoid(diff)


def centering(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """TRL's reward centering term ``mean((chosen + rejected) ** 2)`` (a scalar)."""
    return ((chosen + rejected) ** 2).mean()


def pair_scores(
    scores: torch.Tensor, labels: torch.Tensor, where: str = "pairwise head"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(chosen scores, rejected scores, margins)``: ``scores`` (rows, 1) or (rows,), and
    ``labels`` as ``split_pairs`` reads them. Rows grouped by example, scores (examples, k, 1)
    with labels (examples, k) or (examples, k, 2), are read in their flattened order."""
    if scores.dim() >= 2 and scores.shape[-1] != 1:
        raise BatchError(
            f"{where}: a pairwise head has one output; got predictions of shape "
            f"{tuple(scores.shape)}"
        )
    lead = tuple(scores.shape[:-1]) if scores.dim() >= 2 else tuple(scores.shape)
    if len(lead) > 1 and tuple(labels.shape[: len(lead)]) == lead:
        labels = labels.reshape(-1, *labels.shape[len(lead) :])
    scores = scores.reshape(-1)
    if labels.shape[0] != scores.shape[0]:
        raise BatchError(
            f"{where}: labels of shape {tuple(labels.shape)} do not match the batch size "
            f"{scores.shape[0]}"
        )
    chosen, rejected, margin = split_pairs(labels.to(scores.device), where)
    return scores[chosen], scores[rejected], margin
