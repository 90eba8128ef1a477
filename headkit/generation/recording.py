"""What generation records at each step: log-probabilities, token heads' outputs and the
states sequence heads pool, keyed by position so that steps are stitched back in order."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..model.headed import HeadedModel
    from .generate import _Plan


#: Logits of chosen tokens kept (elements) before their log-probabilities are computed together:
#: one batched log-softmax per this many elements instead of three operations per step.
MAX_PENDING_LOGITS = 2**22


class Recorder:
    """Per-forward results keyed by the absolute position of the forward's first new token,
    so a chunked prefill or a step that generate later undoes is stitched back in order.

    A step adds nothing of its own to the backbone's and the heads' work: the next-token
    logits are kept (a reference) until the token they chose is known, and the
    log-probabilities of up to ``MAX_PENDING_LOGITS`` such logits are computed in one batched
    call (``flush``)."""

    def __init__(self) -> None:
        self.pending: torch.Tensor | None = None  # the last step's next-token logits (batch, vocab)
        self.chosen: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # position, logits, token
        self.logprobs: dict[int, torch.Tensor] = {}  # position → (batch,)
        self.token_outputs: dict[str, dict[int, torch.Tensor]] = {}
        self.states: dict[int, dict[int, torch.Tensor]] = {}  # layer → position → states
        self.last_position_ids: torch.Tensor | None = None

    def record(
        self,
        past: int,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        captured: dict[int, torch.Tensor],
        logits: torch.Tensor | None,
        headed: HeadedModel,
        plan: _Plan,
    ) -> None:
        if self.pending is not None and input_ids is not None:
            self.choose(past, input_ids[:, :1])
        self.pending = None if logits is None else logits[:, -1]  # (batch, vocab)
        if position_ids is not None:
            self.last_position_ids = position_ids[..., -1:]
        for name, layer in plan.token_heads.items():
            out = headed.heads[name](captured[layer])  # (batch, new, num_outputs)
            self.token_outputs.setdefault(name, {})[past] = out
        for layer in set(plan.sequence_heads.values()):
            self.states.setdefault(layer, {})[past] = captured[layer]

    def choose(self, position: int, tokens: torch.Tensor) -> None:
        """The (batch, 1) ``tokens`` at ``position`` were chosen from the pending logits: their
        log-probabilities (log-softmax of the logits, in float32) are due."""
        self.chosen.append((position, self.pending, tokens))
        held = sum(_held(logits) for _, logits, _ in self.chosen)
        if held >= MAX_PENDING_LOGITS:
            self.flush()

    def flush(self) -> None:
        """Compute the log-probabilities of every chosen token still due, in one batch."""
        if not self.chosen:
            return
        positions, logits, tokens = zip(*self.chosen)
        self.chosen = []
        stacked = torch.stack(logits).float()  # (steps, batch, vocab)
        # log_softmax's fused kernel: a third of logsumexp's time (max, subtract, exp, sum
        # and log as separate passes), and the value a plain forward's log_softmax gives
        logprobs = stacked.log_softmax(-1).gather(-1, torch.stack(tokens)).squeeze(-1)
        for i, position in enumerate(positions):
            self.logprobs[position] = logprobs[i]


def _held(t: torch.Tensor) -> int:
    """Elements a kept view holds alive (its whole storage: a prompt's logits over every
    position, when they were computed so)."""
    return t.untyped_storage().nbytes() // t.element_size()


def stitch(pieces: dict[int, torch.Tensor], start: int, stop: int) -> torch.Tensor:
    """Positions ``start..stop-1`` of per-forward pieces (batch, n, ...) keyed by first position;
    a later piece overwrites an earlier one at the same positions. One concatenation,
    whatever the number of pieces."""
    owner: dict[int, int] = {}  # position → the first position of the piece it is taken from
    for pos in sorted(pieces):
        for q in range(max(pos, start), min(pos + pieces[pos].shape[1], stop)):
            owner[q] = pos
    missing = [q for q in range(start, stop) if q not in owner][:5]
    if missing:
        raise RuntimeError(f"generate recorded no states at positions {missing} (headkit bug)")
    if stop <= start:
        first = next(iter(pieces.values()))
        return first.new_zeros((first.shape[0], 0, *first.shape[2:]))
    runs: list[torch.Tensor] = []  # consecutive positions taken from one piece: one slice
    q = start
    while q < stop:
        pos, end = owner[q], q
        while end < stop and owner[end] == pos:
            end += 1
        runs.append(pieces[pos][:, q - pos : end - pos])
        q = end
    return torch.cat(runs, 1)


def until_eos(generated: torch.Tensor, eos: Any) -> torch.Tensor:
    """(rows, N) → 1 up to and including each row's first eos token, 0 after it."""
    if eos is None:
        return torch.ones_like(generated)
    ids = torch.as_tensor(eos, device=generated.device).flatten()  # an id, ids or a tensor
    is_eos = torch.isin(generated, ids).long()
    ended_before = is_eos.cumsum(-1) - is_eos  # eos tokens strictly before each position
    return (ended_before == 0).long()
