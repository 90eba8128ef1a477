"""Labels are checked and counted once for every head that reads them alike (``head_losses``),
and each head adds only its own loss: the result is what ``head_loss`` gives head by head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headkit import HeadConfig
from headkit.errors import BatchError, ConfigError
from headkit.losses import LOSSES, LossSpec, head_loss
from headkit.losses.shared import head_losses

MASK = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]])


def _configs() -> dict[str, HeadConfig]:
    heads = [
        HeadConfig("a", in_size=4, num_outputs=3, target="t"),
        HeadConfig("b", in_size=4, num_outputs=3, target="t"),  # shares a's counted labels
        HeadConfig("c", in_size=4, num_outputs=3, target="t", ignore_pads=False),
        HeadConfig("lm", in_size=4, num_outputs=3, target="t", is_causal_lm=True),
        HeadConfig("v", in_size=4, num_outputs=1, target="v", is_regression=True, loss_fct="mse"),
        HeadConfig("m", in_size=4, num_outputs=1, target="v", is_regression=True,
                   loss_fct="masked_mse"),
    ]  # fmt: skip
    return {c.name: c for c in heads}


def test_shared_labels_give_each_head_exactly_its_own_loss() -> None:
    g = torch.Generator().manual_seed(0)
    configs = _configs()
    preds = {n: torch.randn(2, 5, c.num_outputs, generator=g) for n, c in configs.items()}
    t = torch.randint(0, 3, (2, 5), generator=g)
    t[0, 1] = -100
    v = torch.randn(2, 5, generator=g)
    v[1, 2] = -100  # counts for mse (refused below), skipped by masked_mse
    labels = {"t": t, "v": torch.where(v == -100, 0.5, v)}
    masks = dict.fromkeys(configs, MASK)
    shared = head_losses(configs, preds, labels, masks)
    for name, cfg in configs.items():
        alone = head_loss(cfg, preds[name], labels[cfg.target], MASK)
        assert torch.equal(shared[name], alone), name
    masked = {**labels, "v": v}
    only_masked = {"m": configs["m"]}
    mine = head_losses(only_masked, preds, masked, masks)["m"]
    keep = MASK.bool() & (v != -100)
    torch.testing.assert_close(mine, F.mse_loss(preds["m"][..., 0][keep], v[keep]))
    with pytest.raises(BatchError, match=r"head 'v' \(target 'v'\): a label is -100"):
        head_losses(configs, preds, masked, masks)


def test_a_class_loss_that_does_not_zero_skipped_labels_itself_is_masked() -> None:
    """Its ``fn`` gives a loss where the label is -100 (here: class 0's); only what counts
    enters the mean, as with cross_entropy, which zeroes them itself (``zeroes_ignored``)."""

    def clamped(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(p, y.clamp(min=0), reduction="none")

    LOSSES.register("clamped_test", LossSpec(clamped, classes=True, ignores_minus_100=True))
    try:
        cfg = HeadConfig("tags", in_size=4, num_outputs=3, loss_fct="clamped_test")
        preds = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(1))
        labels = torch.tensor([[0, 1, -100, 2, 1], [2, 2, 1, -100, 0]])
        keep = MASK.bool() & (labels != -100)
        want = F.cross_entropy(preds[keep], labels[keep])
        torch.testing.assert_close(head_loss(cfg, preds, labels, MASK), want)
    finally:
        LOSSES.remove("clamped_test")


def test_zeroes_ignored_on_a_value_loss_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"zeroes_ignored=True is only read for class losses"):
        LossSpec(lambda p, y: (p - y) ** 2, zeroes_ignored=True)
