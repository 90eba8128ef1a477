"""Batched linear probes: each layer, pooling, validation split, label variant and L2 value
as columns of one tensor.

Features ``x`` are (B, N, d): B probing problems (one per layer and pooling of one width) over
N training rows. Output columns are indexed (split, variant, l2[, class]). Every column group
is an independent problem that shares only its input features with the others:

- classification: multinomial logistic regression, ``mean CE over the fit rows + l2 * |W|^2``
  (the bias is not penalised), minimised by Nesterov-accelerated gradient steps preconditioned
  with Böhning's bound on the Hessian, ``0.5 * A^T A / n + 2 * l2`` (A = features with a ones
  column). The bound holds at every point, so one eigendecomposition per problem serves every
  iteration, split and L2, and 30-100 steps reach the optimum to ~1e-5 of the objective.
- regression: ridge, ``mean squared error over the fit rows + l2 * |w|^2``, solved exactly.

Validation splits differ in which training rows are held back for validation (``fit``
weights); each (problem, split, variant) keeps the L2 with the best validation score.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from ..errors import ConfigError

#: Default L2 grid (per-row mean loss + l2 * |w|^2 on standardised features).
DEFAULT_L2 = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)


#: Torch threads the probe fitting runs on. Its matrices are small, so more threads mostly
#: wait for each other: on a loaded 2-core machine 2 threads took 55-73 s where 1 took
#: 5.4-6.6 s (7 layers × 480 reviews × 384 features, 3 splits, control task, 5 penalties;
#: docs/probing.md). The backbone pass keeps torch's own setting (``--threads``).
FIT_THREADS = 1


@contextlib.contextmanager
def fit_threads(n: int | None = FIT_THREADS) -> Iterator[None]:
    """Run the block on at most ``n`` torch threads (None: as set), then restore the count."""
    before = torch.get_num_threads()
    if n is not None and n < before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_penalties(l2: Sequence[float] | Any) -> None:
    """Refuse an L2 grid that is empty or holds anything but finite numbers > 0 (a NaN or
    infinite penalty fits nothing and would score at the baseline without a word)."""
    try:
        values = list(l2)
    except TypeError:
        values = None
    if not values or any(
        isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
        for v in values
    ):
        raise ConfigError(
            f"l2={l2!r} is invalid; allowed: one or more finite penalties > 0 "
            "(e.g. [1e-4, 1e-2, 1.0])",
            field="l2",
            value=l2,
        )


@dataclass
class FitScores:
    """Scores of the chosen probes. Shapes (B, S, V) unless noted: S validation splits, V
    label variants.

    ``test_items`` is (B, S, V, n_test): per held-out row, 1/0 correctness (classification)
    or the squared error (regression), for bootstrap intervals.
    """

    train: torch.Tensor
    val: torch.Tensor
    test: torch.Tensor
    l2: torch.Tensor
    test_items: torch.Tensor
    refit: Refit | None = None
    val_loss: torch.Tensor | None = None


@dataclass
class Refit:
    """The probe refitted on every training row with the L2 the validation splits chose most
    often (ties: the stronger): ``weight`` (B, d, V, C) and ``bias`` (B, V, C) on the
    standardised features (C = 1 for regression), ``l2`` and ``train`` score (B, V)."""

    weight: torch.Tensor
    bias: torch.Tensor
    l2: torch.Tensor
    train: torch.Tensor


def standardisation(train: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, scale) of each feature of each problem (B, N, d) over the training rows, each
    (B, 1, d): standardised = (x - mean) * scale. A feature that is constant on the training
    rows gets scale 0 (it becomes 0 everywhere, not noise / 1e-6)."""
    mu = train.mean(1, keepdim=True)
    sd = train.std(1, keepdim=True)
    flat = sd <= 1e-6 * (mu.abs() + 1.0)
    return mu, torch.where(flat, torch.zeros_like(sd), 1.0 / sd.clamp(min=1e-30))


def standardise(train: torch.Tensor, *others: torch.Tensor) -> list[torch.Tensor]:
    """Centre and scale each feature of each problem (B, N, d) by the training rows'
    statistics (``standardisation``)."""
    mu, scale = standardisation(train)
    return [(x - mu) * scale for x in (train, *others)]


def fit_and_score(
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    fit: torch.Tensor,
    l2: torch.Tensor,
    num_classes: int | None,
    max_iter: int = 200,
    tol: float = 1e-4,
    bar: tqdm | None = None,
    refit: bool = False,
    select: str = "accuracy",
) -> FitScores:
    """Train every probe on standardised ``x_train`` (B, N, d) and score the chosen ones.

    ``y_train`` (V, N) and ``y_test`` (V, n_test): class indices (``num_classes`` given) or
    values (``num_classes=None``: ridge). ``fit`` (S, N) bool: the rows each validation split
    trains on; the others validate. ``l2`` (K,). ``refit``: also fit every training row with
    the L2 the splits chose (``FitScores.refit``), in the same batched solve.
    """
    n_splits = fit.shape[0]
    if refit:
        fit = torch.cat([fit, torch.ones_like(fit[:1])])  # the last "split": every row
    fit_w = fit.float() / fit.sum(1, keepdim=True).float()  # (S, N), 1/n_fit on fit rows
    val = ~fit
    val_w = val.float() / val.sum(1, keepdim=True).clamp(min=1).float()
    if num_classes is None:
        w, b = _fit_ridge(x_train, y_train.float(), fit_w, l2)
        if bar is not None:
            bar.update(max_iter)
        pred = _linear(x_train, w, b)  # (B, N, S, V, K)
        train_score = _weighted_r2(pred, y_train.float(), fit_w)
        val_score = _weighted_r2(pred, y_train.float(), val_w)
    else:
        w, b = _fit_softmax(x_train, y_train, fit_w, l2, num_classes, max_iter, tol, bar)
        logits = _linear(x_train, w, b)  # (B, N, S, V, K, C)
        correct = (logits.argmax(-1) == _lead(y_train, 2)).float()
        train_score = torch.einsum("bnsvk,sn->bsvk", correct, fit_w)
        val_score = torch.einsum("bnsvk,sn->bsvk", correct, val_w)
        label = _lead(y_train, 2)[..., None].expand(*logits.shape[:-1], 1)
        nll = -torch.log_softmax(logits, -1).gather(-1, label)[..., 0]  # (B, N, S, V, K)
        val_loss = torch.einsum("bnsvk,sn->bsvk", nll, val_w)
        del logits, nll
    if num_classes is None:
        val_loss = -val_score  # ridge: R^2 is already a continuous score
    # what L2 and layers are chosen on: the validation score, or (select="loss") minus the
    # validation log-loss, a smoother criterion than accuracy on a few hundred rows
    criterion = -val_loss if select == "loss" else val_score
    if refit:
        kept = _refit(w, b, train_score, criterion, l2, n_splits, num_classes is None)
        w, b = w[:, :, :n_splits], b[:, :n_splits]
        train_score, val_score = train_score[:, :n_splits], val_score[:, :n_splits]
        val_loss, criterion = val_loss[:, :n_splits], criterion[:, :n_splits]
    # Best validation score; ties go to the stronger penalty (the later grid entry if sorted).
    order = torch.argsort(torch.argsort(l2)).to(val_score)  # rank of each l2, 0 = weakest
    pick = (criterion + order * 1e-7).argmax(-1)  # (B, S, V)
    gather = pick[..., None]
    test_pred = _linear(x_test, w, b)  # (B, n_test, S, V, K[, C])
    idx = gather[:, None].expand(-1, test_pred.shape[1], -1, -1, -1)
    if num_classes is None:
        chosen = test_pred.gather(-1, idx)[..., 0]  # (B, n_test, S, V)
        items = (chosen - _lead(y_test.float(), 1)) ** 2
    else:
        hat = test_pred.argmax(-1).gather(-1, idx)[..., 0]
        items = (hat == _lead(y_test, 1)).float()
    items = items.permute(0, 2, 3, 1).contiguous()  # (B, S, V, n_test)
    return FitScores(
        train=train_score.gather(-1, gather)[..., 0],
        val=val_score.gather(-1, gather)[..., 0],
        val_loss=val_loss.gather(-1, gather)[..., 0],
        test=score_items(items, y_test, num_classes is None),
        l2=l2[pick],
        test_items=items,
        refit=kept if refit else None,
    )


def _refit(w, b, train_score, val_score, l2, n_splits: int, regression: bool) -> Refit:
    """The last split's probes (fitted on every training row) at the L2 the first
    ``n_splits`` splits chose most often (ties: the stronger penalty)."""
    order = torch.argsort(torch.argsort(l2))  # rank of each l2, 0 = weakest
    picks = (val_score[:, :n_splits] + order.to(val_score) * 1e-7).argmax(-1)  # (B, S, V)
    votes = torch.nn.functional.one_hot(picks, l2.numel()).sum(1).double()  # (B, V, K)
    chosen = (votes + order.double() * 1e-3).argmax(-1)  # (B, V)
    last = w[:, :, n_splits]  # (B, d, V, K[, C])
    if regression:
        last, bias = last[..., None], b[:, n_splits][..., None]  # C = 1
    else:
        bias = b[:, n_splits]
    at = chosen[:, None, :, None, None].expand(-1, last.shape[1], -1, 1, last.shape[-1])
    weight = last.gather(3, at)[:, :, :, 0]  # (B, d, V, C)
    bias = bias.gather(2, chosen[:, :, None, None].expand(-1, -1, 1, bias.shape[-1]))[:, :, 0]
    train = train_score[:, n_splits].gather(-1, chosen[..., None])[..., 0]
    return Refit(weight=weight, bias=bias, l2=l2[chosen], train=train)


def score_items(items: torch.Tensor, y: torch.Tensor, regression: bool) -> torch.Tensor:
    """Accuracy (mean of 1/0 items) or R^2 = 1 - SS_res / SS_tot over the last axis.

    ``y`` (V, n) for R^2; SS_tot uses the two-pass formula (centre first, then square).
    """
    if not regression:
        return items.mean(-1)
    return 1.0 - items.sum(-1) / _ss_tot(y.double()).to(items)


def _ss_tot(y: torch.Tensor) -> torch.Tensor:
    centred = y - y.mean(-1, keepdim=True)
    return (centred * centred).sum(-1).clamp(min=1e-30)


def bootstrap_interval(
    items: torch.Tensor, y: torch.Tensor, regression: bool, resamples: int, seed: int
) -> torch.Tensor:
    """95% percentile interval of the split-averaged held-out score, resampling held-out rows.

    ``items`` (B, S, V, n); returns (B, V, 2). The same resamples serve every problem.
    """
    n = items.shape[-1]
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(n, (resamples, n), generator=g)
    counts = torch.zeros(resamples, n).scatter_add_(1, index, torch.ones(resamples, n))
    if regression:
        ss_res = torch.einsum("bsvn,rn->bsvr", items.double(), counts.double())
        # SS_tot of each resample from weighted sums; centring first keeps it stable.
        yc = y.double() - y.double().mean(-1, keepdim=True)  # (V, n)
        mc = yc @ counts.double().T / n
        sq = torch.einsum("vn,rn->vr", yc * yc, counts.double()) - n * mc * mc
        scores = (1.0 - ss_res / sq.clamp(min=1e-30)[None, None]).mean(1)  # (B, V, R)
    else:
        scores = items.mean(1) @ counts.T / n  # (B, V, R)
    q = torch.tensor([0.025, 0.975], dtype=scores.dtype)
    return torch.quantile(scores.float(), q.float(), dim=-1).permute(1, 2, 0)


# ---------------------------------------------------------------------- solvers
def _lead(y: torch.Tensor, trailing: int) -> torch.Tensor:
    """(V, N) labels → (1, N, 1, V[, 1 × trailing-1]) to broadcast against (B, N, S, V, K...)."""
    out = y.T[None, :, None, :]
    for _ in range(trailing - 1):
        out = out[..., None]
    return out


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x (B, N, d) with w (B, d, *out) and b (B, *out) → (B, N, *out)."""
    out_shape = w.shape[2:]
    flat = torch.bmm(x, w.reshape(w.shape[0], w.shape[1], -1)) + b.reshape(b.shape[0], 1, -1)
    return flat.view(*flat.shape[:2], *out_shape)


def _fit_ridge(
    x: torch.Tensor, y: torch.Tensor, fit_w: torch.Tensor, l2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact ridge per (problem, split, variant, l2): w (B, d, S, V, K), b (B, S, V, K)."""
    xd, yd, wd = x.double(), y.double(), fit_w.double()
    mean_x = torch.einsum("sn,bnd->bsd", wd, xd)  # (B, S, d)
    mean_y = wd @ yd.T  # (S, V)
    gram = torch.einsum("bnd,sn,bne->bsde", xd, wd, xd) - torch.einsum(
        "bsd,bse->bsde", mean_x, mean_x
    )
    cross = torch.einsum("bnd,sn,vn->bsdv", xd, wd, yd) - torch.einsum(
        "bsd,sv->bsdv", mean_x, mean_y
    )
    evals, evecs = torch.linalg.eigh(gram)  # (B, S, d), (B, S, d, d)
    proj = evecs.transpose(-1, -2) @ cross  # (B, S, d, V)
    scaled = proj[..., None] / (evals[..., None, None] + l2.double())  # (B, S, d, V, K)
    w = torch.einsum("bsde,bsevk->bsdvk", evecs, scaled)
    b = mean_y[None, :, :, None] - torch.einsum("bsd,bsdvk->bsvk", mean_x, w)
    return w.permute(0, 2, 1, 3, 4).float().contiguous(), b.float()


def _fit_softmax(
    x: torch.Tensor,
    y: torch.Tensor,
    fit_w: torch.Tensor,
    l2: torch.Tensor,
    num_classes: int,
    max_iter: int,
    tol: float,
    bar: tqdm | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """L2 softmax regression per (problem, split, variant, l2): w (B, d, S, V, K, C), b.

    Two classes are fitted as one logistic regression on the logit difference u with penalty
    ``l2/2 |u|^2``: the 2-class softmax optimum is ``w1 = -w0 = u/2`` (the penalty splits u
    evenly), so the predictions are the same for half the work.
    """
    n_probs, n, d = x.shape
    groups = (fit_w.shape[0], y.shape[0], l2.numel())  # (S, V, K)
    binary = num_classes == 2
    c = 1 if binary else num_classes
    out = (*groups, c)
    # Böhning: the CE Hessian is <= q A^T A / n_fit <= q (N / min n_fit) A^T A / N, with
    # q = 1/4 for the logistic loss and 1/2 for softmax.
    curvature, pen = (0.25, l2) if binary else (0.5, 2 * l2)  # pen: gradient of the penalty
    n_fit = float((fit_w > 0).sum(1).min())
    xa = torch.cat([x, torch.ones(n_probs, n, 1)], -1)  # (B, N, d+1): features and a bias
    xa_t = xa.transpose(1, 2).contiguous()
    # float32 is precise enough: the bound only sets step sizes, not where the optimum is.
    evals, evecs = torch.linalg.eigh(torch.bmm(xa_t, xa) / n)
    evecs_t = evecs.transpose(1, 2).contiguous()
    pen_of = (torch.zeros(out) + pen[None, None, :, None]).reshape(1, 1, -1)  # (1, 1, O)
    denom = curvature * (n / n_fit) * evals.clamp(min=0)[:, :, None] + pen_of  # (B, d+1, O)
    penalty = pen_of[0].expand(d + 1, -1).clone()
    penalty[d] = 0.0  # no penalty on the bias
    labels = y.float()[..., None] if binary else torch.nn.functional.one_hot(y, c).float()
    # (N, S, V, K, C) targets and fit weights, flattened to (N, O)
    target = labels.permute(1, 0, 2)[:, None, :, None, :].expand(n, *out).reshape(n, -1)
    rows = fit_w.T[:, :, None, None, None].expand(n, *out).reshape(n, -1)
    current = torch.zeros(n_probs, d + 1, rows.shape[1])
    point = current.clone()
    momentum = torch.ones(n_probs, 1, *groups, 1)  # Nesterov t per problem and group
    for _ in range(max_iter):
        logits = torch.bmm(xa, point)  # (B, N, O)
        if binary:
            prob = torch.sigmoid(logits)
        else:  # softmax by hand: torch.softmax over a last axis of a few classes is slower
            prob = logits.view(n_probs, n, -1, c)
            prob = (prob - prob.amax(-1, keepdim=True)).exp_()
            prob = (prob / prob.sum(-1, keepdim=True)).view(n_probs, n, -1)
        grad = torch.bmm(xa_t, (prob - target) * rows) + penalty * point  # (B, d+1, O)
        new = point - torch.bmm(evecs, torch.bmm(evecs_t, grad) / denom)
        # Adaptive restart (O'Donoghue & Candès): drop momentum where it points uphill.
        moved = (new - current).view(n_probs, d + 1, *out)
        uphill = ((grad.view_as(moved) * moved).sum((1, 5), keepdim=True) > 0).float()
        t_next = (1 + torch.sqrt(1 + 4 * momentum * momentum)) / 2
        beta = (momentum - 1) / t_next * (1 - uphill)
        point = new + (beta * moved).view_as(new)
        change = moved.abs().amax() / current.abs().amax().clamp(min=1e-3)
        current, momentum = new, torch.where(uphill > 0, torch.ones_like(t_next), t_next)
        if bar is not None:
            bar.update(1)
        if float(change) < tol:
            break
    w = current.view(n_probs, d + 1, *out)
    if binary:
        w = torch.cat([-w / 2, w / 2], -1)
    return w[:, :d], w[:, d]


def _weighted_r2(pred: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """R^2 of ``pred`` (B, N, S, V, K) on the rows weighted by ``rows`` (S, N) → (B, S, V, K)."""
    yd, pd, wd = y.double(), pred.double(), rows.double()
    mean = wd @ yd.T  # (S, V)
    centred = yd.T[:, None, :] - mean[None]  # (N, S, V)
    ss_tot = torch.einsum("sn,nsv->sv", wd, centred * centred).clamp(min=1e-30)
    err = pd - yd.T[None, :, None, :, None]
    ss_res = torch.einsum("bnsvk,sn->bsvk", err * err, wd)
    return (1.0 - ss_res / ss_tot[None, :, :, None]).float()
