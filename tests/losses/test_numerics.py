"""Numbers stay finite and exact where the exact answer is finite: poolings of
half-precision and huge states, max pooling of -inf, and R² of labels with a large offset."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from headkit import HeadConfig
from headkit.heads.pooling import SequencePooling
from headkit.metrics import HeadMetric


# ---------------------------------------------------------------------- poolings
def test_mean_sqrt_len_of_float16_states_is_exact_beyond_the_float16_range():
    """4,096 tokens of 2,000: sum / sqrt(4096) = 128,000, which float16 cannot hold."""
    hidden = torch.full((1, 4096, 3), 2000.0, dtype=torch.float16)
    mask = torch.ones(1, 4096, dtype=torch.long)
    got = SequencePooling(["mean_sqrt_len"], 3)(hidden, mask)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.full((1, 3), 128_000.0))


def test_weighted_mean_of_100000_large_bfloat16_states_is_finite_and_exact():
    """Weights 1..100,000 sum to 5e9; times 2**120 that overflows float32 if summed plainly."""
    value = 2.0**120
    hidden = torch.full((2, 100_000, 2), value, dtype=torch.bfloat16)
    mask = torch.ones(2, 100_000, dtype=torch.long)
    mask[1, :40_000] = 0  # left padding: weights restart at the first real token
    for name in ("weighted_mean", "mean"):
        got = SequencePooling([name], 2)(hidden, mask)
        assert torch.equal(got, torch.full((2, 2), value)), name


def test_averages_of_float32_states_near_the_float32_maximum_stay_finite():
    hidden = torch.tensor([[[3e38, -3e38], [3e38, -3e38], [1.0, 2.0]]])
    mask = torch.tensor([[1, 1, 0]])
    got = SequencePooling(["mean", "weighted_mean"], 2)(hidden, mask)
    torch.testing.assert_close(got, torch.tensor([[3e38, -3e38, 3e38, -3e38]]))


def test_averages_are_bit_identical_to_the_plain_float32_formula():
    """The power-of-two scaling that prevents overflow changes no bit of ordinary results."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 33, 16, generator=g) * 10.0 ** torch.randint(-3, 4, (4, 1, 16))
    mask = (torch.rand(4, 33, generator=g) > 0.3).long()
    m = mask.unsqueeze(-1).float()
    count = m.sum(1).clamp(min=1)
    weights = (mask.cumsum(-1) * mask).unsqueeze(-1).float()
    want = {
        "mean": (hidden * m).sum(1) / count,
        "mean_sqrt_len": (hidden * m).sum(1) / count.sqrt(),
        "weighted_mean": (hidden * weights).sum(1) / weights.sum(1).clamp(min=1),
    }
    for name, expected in want.items():
        assert torch.equal(SequencePooling([name], 16)(hidden, mask), expected), name


def test_max_pooling_of_minus_inf_real_tokens_is_minus_inf_with_or_without_padding():
    hidden = torch.tensor([[[-math.inf, 1.0], [-math.inf, 2.0], [5.0, 7.0]]])
    pool = SequencePooling(["max"], 2)
    padded = pool(hidden, torch.tensor([[1, 1, 0]]))
    unpadded = pool(hidden[:, :2], torch.tensor([[1, 1]]))
    assert torch.equal(padded, torch.tensor([[-math.inf, 2.0]]))
    assert torch.equal(padded, unpadded)
    assert torch.equal(pool(hidden, torch.zeros(1, 3)), torch.zeros(1, 2))  # no real token: 0


# ---------------------------------------------------------------------- R²
def _r2_two_pass(p: np.ndarray, y: np.ndarray) -> float:
    """R² per output in float64, two passes (mean first), averaged over outputs."""
    ss_res = ((y - p) ** 2).sum(0)
    ss_tot = ((y - y.mean(0)) ** 2).sum(0)
    return float((1 - ss_res / ss_tot).mean())


@pytest.mark.parametrize("batch", [1, 7, 100])
def test_r2_is_exact_for_labels_with_a_large_offset(batch: int):
    """Labels 1e8 + x: Σy² − (Σy)²/n cancels to noise (0.0 or 0.9976 before); the merged
    per-batch means and squared deviations give the two-pass value."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 2))
    y = 1e8 + x
    p = y + rng.normal(scale=[0.1, 0.0995], size=(100, 2))
    want = _r2_two_pass(p, y)
    assert 0.98 < want < 0.995  # an R² of about 0.99, as in the issue
    cfg = HeadConfig(
        "reg", num_outputs=2, pred_for_sequence=True, is_regression=True, loss_fct="mse"
    )
    metric = HeadMetric(cfg)
    for i in range(0, 100, batch):
        metric.update(p[i : i + batch], y[i : i + batch])
    assert metric.compute()["r2"] == pytest.approx(want, rel=1e-9, abs=1e-9)
