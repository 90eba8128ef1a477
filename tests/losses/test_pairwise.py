"""The Bradley–Terry loss, how pairs travel in a batch, and the pairwise metrics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headkit import HeadConfig
from headkit.errors import BatchError, ConfigError
from headkit.losses.objective import LOSSES, head_loss, label_rule
from headkit.losses.pairwise import preference_labels, split_pairs
from headkit.metrics import compute_head_metrics


def reward_head(**kw) -> HeadConfig:
    return HeadConfig("reward", pred_for_sequence=True, loss_fct="bradley_terry", **kw)


def trl_loss(chosen, rejected, margin=None, center=None):
    """TRL RewardTrainer.compute_loss's formula, written out as it is there."""
    if margin is not None:
        loss = -F.logsigmoid(chosen - rejected - margin).mean()
    else:
        loss = -F.logsigmoid(chosen - rejected).mean()
    if center is not None:
        loss += center * torch.mean((chosen + rejected) ** 2)
    return loss


def test_bradley_terry_is_registered_as_a_pairwise_sequence_loss():
    spec = LOSSES.get("bradley_terry")
    assert spec.pairwise and spec.metric == "pairwise" and not spec.classes
    rule = label_rule(reward_head())
    assert (rule.layout, rule.task, rule.ignore_index, rule.dtype) == (
        "sequence",
        "pairwise",
        -100,
        torch.float32,
    )


@pytest.mark.parametrize("center", [None, 0.01])
@pytest.mark.parametrize("with_margin", [False, True])
def test_loss_equals_trl_formula_on_trl_layout(center, with_margin):
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(10, 1, generator=g)
    margins = torch.rand(5, generator=g) if with_margin else None
    labels = preference_labels(5, margins=margins)  # chosen rows 0-4, rejected rows 5-9
    ours = head_loss(reward_head(center_rewards_coefficient=center), scores, labels, None)
    theirs = trl_loss(scores[:5, 0], scores[5:, 0], margins, center)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)


def test_kth_chosen_pairs_with_kth_rejected_anywhere_in_the_batch():
    scores = torch.tensor([[3.0], [9.0], [1.0], [7.0], [2.0], [0.0]])
    labels = torch.tensor([-100.0, 1, 0, -100, 1, 0])  # pairs (1, 2) and (4, 5)
    loss = head_loss(reward_head(), scores, labels, None)
    torch.testing.assert_close(loss, trl_loss(torch.tensor([9.0, 2.0]), torch.tensor([1.0, 0.0])))


def test_two_heads_each_read_their_own_rows():
    scores = torch.randn(8, 1)
    helpful = preference_labels(2, rows=8, start=0)
    harmless = preference_labels(2, rows=8, start=4)
    assert split_pairs(helpful)[0].tolist() == [0, 1]
    assert split_pairs(harmless)[1].tolist() == [6, 7]
    loss = head_loss(reward_head(), scores, harmless, None)
    torch.testing.assert_close(loss, trl_loss(scores[4:6, 0], scores[6:8, 0]))


def test_no_pair_gives_an_exact_zero_in_the_graph():
    scores = torch.randn(4, 1, requires_grad=True)
    loss = head_loss(reward_head(), scores, torch.full((4,), -100.0), None)
    assert loss.item() == 0.0
    loss.backward()
    assert scores.grad is not None and scores.grad.abs().sum() == 0


def test_gradients_push_chosen_up_and_rejected_down():
    scores = torch.zeros(4, 1, requires_grad=True)
    head_loss(reward_head(), scores, preference_labels(2), None).backward()
    assert (scores.grad[:2] < 0).all() and (scores.grad[2:] > 0).all()


def test_metrics_pairwise_accuracy_and_mean_margin():
    scores = torch.tensor([[2.0], [0.0], [1.0], [1.0]])  # pairs (2 vs 1) and (0 vs 1)
    m = compute_head_metrics(reward_head(), scores, preference_labels(2))
    assert m == {"pairwise_accuracy": 0.5, "mean_margin": 0.0}


def test_a_tie_is_not_a_correct_pair_as_in_trl():
    m = compute_head_metrics(reward_head(), torch.zeros(2, 1), preference_labels(1))
    assert m["pairwise_accuracy"] == 0.0


@pytest.mark.parametrize(
    "rows, labels, match",
    [
        (3, torch.tensor([1.0, 1.0, 0.0]), "2 chosen and 1 rejected"),
        (2, torch.tensor([1.0, 2.0]), "value 2 is invalid"),
        (2, torch.tensor([[1.0, float("nan")], [0.0, 0.0]]), "margin is NaN"),
        (2, torch.ones(2, 3), "do not fit"),
        (2, torch.tensor([1.0, 0.0, 1.0, 0.0]), "do not match the batch size 2"),
        (2, torch.tensor([1 + 0j, 0j]), "numeric labels"),
    ],
)
def test_bad_pair_labels_are_batch_errors(rows, labels, match):
    with pytest.raises(BatchError, match=match):
        head_loss(reward_head(), torch.zeros(rows, 1), labels, None)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"pred_for_sequence": False}, "set pred_for_sequence=True"),
        ({"num_outputs": 2}, "num_outputs=1"),
        ({"center_rewards_coefficient": -1.0}, "finite number >= 0"),
        ({"center_rewards_coefficient": float("inf")}, "finite number >= 0"),
        ({"loss_fct": "mse", "center_rewards_coefficient": 0.1}, "applies to pairwise losses"),
    ],
)
def test_reward_head_config_errors(kw, match):
    base = {"name": "reward", "pred_for_sequence": True, "loss_fct": "bradley_terry", **kw}
    with pytest.raises(ConfigError, match=match):
        HeadConfig(**base)


def test_center_rewards_coefficient_round_trips_through_json():
    cfg = reward_head(center_rewards_coefficient=0.01)
    assert HeadConfig.from_json(cfg.to_json()) == cfg
    assert "center_rewards_coefficient" not in reward_head().to_dict()


def test_bool_and_integer_labels_read_as_their_float_roles():
    scores = torch.randn(4, 1)
    want = head_loss(reward_head(), scores, preference_labels(2), None)
    for labels in (torch.tensor([True, True, False, False]), torch.tensor([1, 1, 0, 0])):
        torch.testing.assert_close(head_loss(reward_head(), scores, labels, None), want)
