"""What generation records at each step: log-probabilities, token heads' outputs and the
states sequence heads pool, keyed by position so that steps are stitched back in order."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..model.headed import HeadedModel
    from .generate import _Plan


class Recorder:
    """Per-forward results keyed by the absolute position of the forward's first new token,
    so a chunked prefill or a step that generate later undoes is stitched back in order."""

    def __init__(self) -> None:
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # last logits, logsumexp
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
            self.logprobs[past] = self.logprob_of(input_ids[:, :1])
        self.pending = None
        if logits is not None:  # log p(token) = logit - logsumexp, read once the token is known
            last = logits[:, -1].float()  # (batch, vocab)
            self.pending = (last, torch.logsumexp(last, -1))
        if position_ids is not None:
            self.last_position_ids = position_ids[..., -1:]
        for name, layer in plan.token_heads.items():
            out = headed.heads[name](captured[layer])  # (batch, new, num_outputs)
            self.token_outputs.setdefault(name, {})[past] = out
        for layer in set(plan.sequence_heads.values()):
            self.states.setdefault(layer, {})[past] = captured[layer]

    def logprob_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """(batch, 1) tokens → (batch,) their log-probabilities under the pending logits."""
        logits, lse = self.pending
        return logits.gather(-1, tokens).squeeze(-1) - lse


def stitch(pieces: dict[int, torch.Tensor], start: int, stop: int) -> torch.Tensor:
    """Positions ``start..stop-1`` of per-forward pieces (batch, n, ...) keyed by first position;
    a later piece overwrites an earlier one at the same positions."""
    first = next(iter(pieces.values()))
    out = first.new_zeros((first.shape[0], stop - start, *first.shape[2:]))
    covered = torch.zeros(stop - start, dtype=torch.bool)  # bookkeeping on the CPU
    for pos in sorted(pieces):
        piece = pieces[pos]
        lo, hi = max(pos, start), min(pos + piece.shape[1], stop)
        if lo < hi:
            out[:, lo - start : hi - start] = piece[:, lo - pos : hi - pos]
            covered[lo - start : hi - start] = True
    if not bool(covered.all()):
        missing = (~covered).nonzero().flatten()[:5].add(start).tolist()
        raise RuntimeError(f"generate recorded no states at positions {missing} (headkit bug)")
    return out


def until_eos(generated: torch.Tensor, eos: Any) -> torch.Tensor:
    """(rows, N) → 1 up to and including each row's first eos token, 0 after it."""
    if eos is None:
        return torch.ones_like(generated)
    ids = torch.as_tensor(eos, device=generated.device).flatten()  # an id, ids or a tensor
    is_eos = torch.isin(generated, ids).long()
    ended_before = is_eos.cumsum(-1) - is_eos  # eos tokens strictly before each position
    return (ended_before == 0).long()
