"""Multi-task loss weighting: fixed, adaptive and uncertainty, checked against hand formulas."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny

from headkit import ConfigError, HeadConfig, HeadedModel

# tiny models gain nothing from more threads, and the machine is shared
pytestmark = pytest.mark.usefixtures("single_thread")

W_A, W_B = 2.0, 0.5


def _model(weighting: str = "fixed", **kwargs) -> HeadedModel:
    heads = [
        HeadConfig("a", num_outputs=3, pred_for_sequence=True, loss_weight=W_A),
        HeadConfig(
            "b",
            pred_for_sequence=True,
            is_regression=True,
            loss_fct="mse",
            loss_weight=W_B,
        ),
    ]
    model = HeadedModel(build_tiny("bert", num_layers=2), heads)
    model.set_loss_weighting(weighting, **kwargs)
    return model


def _batch(seed: int, a: bool = True, b: bool = True) -> dict:
    g = torch.Generator().manual_seed(seed)
    batch = {"input_ids": torch.randint(1, 100, (4, 5), generator=g)}
    if a:
        batch["a"] = torch.randint(0, 3, (4,), generator=g)
    if b:
        batch["b"] = torch.randn(4, generator=g) * 2
    return batch


def _raw_losses(out, batch) -> dict[str, torch.Tensor]:
    """Each head's loss computed here from its predictions (the reference)."""
    ref = {}
    if "a" in batch:
        ref["a"] = F.cross_entropy(out.preds_by_head["a"], batch["a"])
    if "b" in batch:
        ref["b"] = F.mse_loss(out.preds_by_head["b"][:, 0], batch["b"])
    return ref


def test_fixed_is_the_weighted_sum() -> None:
    model = _model("fixed")
    batch = _batch(0)
    out = model(**batch)
    ref = _raw_losses(out, batch)
    for k, w in (("a", W_A), ("b", W_B)):
        torch.testing.assert_close(out.loss_by_head[k], ref[k])
        torch.testing.assert_close(out.adapted_loss_by_head[k], w * ref[k])
    torch.testing.assert_close(out.loss, W_A * ref["a"] + W_B * ref["b"])


def test_adaptive_is_zero_during_warmup_then_standardised() -> None:
    warmup = 3
    model = _model("adaptive", warmup=warmup).train()
    seen: dict[str, list[float]] = {"a": [], "b": []}
    for step in range(6):
        batch = _batch(step)
        with torch.no_grad():  # statistics follow training mode, not gradients
            out = model(**batch)
        ref = _raw_losses(out, batch)
        for k, w in (("a", W_A), ("b", W_B)):
            got = float(out.adapted_loss_by_head[k])
            if step < warmup:
                assert got == 0.0
            else:
                prev = np.array(seen[k])
                expected = w * (float(ref[k]) - prev.mean()) / prev.std(ddof=1)
                assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
            seen[k].append(float(ref[k]))
        if step < warmup:
            assert float(out.loss) == 0.0
    # evaluation does not move the statistics
    before = {k: v.clone() for k, v in model.loss_weighting.state_dict().items()}
    with torch.no_grad():
        model.eval()(**_batch(99))
    for k, v in model.loss_weighting.state_dict().items():
        assert torch.equal(v, before[k])


def test_adaptive_with_momentum_uses_exponential_statistics() -> None:
    m = 0.3
    model = _model("adaptive", warmup=2, momentum=m).train()
    mean = var = None
    for step in range(5):
        batch = _batch(step, b=False)
        with torch.no_grad():
            out = model(**batch)
        x = float(_raw_losses(out, batch)["a"])
        if step >= 2:
            expected = W_A * (x - mean) / max(var**0.5, 1e-6)
            assert float(out.adapted_loss_by_head["a"]) == pytest.approx(expected, rel=1e-5)
        if mean is None:
            mean, var = x, 0.0
        else:
            d = x - mean
            mean, var = mean + m * d, (1 - m) * (var + m * d * d)
    assert model.loss_weighting.config() == {"name": "adaptive", "warmup": 2, "momentum": m}
    with pytest.raises(ConfigError, match=r"momentum=1\.5"):
        model.set_loss_weighting("adaptive", momentum=1.5)


def test_adaptive_statistics_survive_save_and_load(tmp_path) -> None:
    model = _model("adaptive", warmup=2, momentum=0.5).train()
    for step in range(3):
        model(**_batch(step))
    model.save_pretrained(tmp_path)
    loaded = HeadedModel.from_pretrained(tmp_path)
    assert loaded.loss_weighting.config() == model.loss_weighting.config()
    for k, v in model.loss_weighting.state_dict().items():
        assert torch.equal(loaded.loss_weighting.state_dict()[k], v)


def test_uncertainty_log_vars_are_learned_saved_and_loaded(tmp_path) -> None:
    model = _model("uncertainty").train()
    log_vars = model.loss_weighting.log_vars
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step in range(4):
        batch = _batch(step)
        out = model(**batch)
        ref = _raw_losses(out, batch)
        for k, w in (("a", W_A), ("b", W_B)):  # w × (exp(-s) L + s)
            s = log_vars[k].detach()
            expected = w * (torch.exp(-s) * ref[k] + s)
            torch.testing.assert_close(out.adapted_loss_by_head[k], expected)
        opt.zero_grad()
        out.loss.backward()
        for k in ("a", "b"):
            assert log_vars[k].grad is not None and float(log_vars[k].grad) != 0.0
        opt.step()
    moved = {k: float(v.detach()) for k, v in log_vars.items()}
    assert all(abs(v) > 1e-3 for v in moved.values()), moved

    model.save_pretrained(tmp_path)
    manifest = json.loads((tmp_path / "head_configs.json").read_text())
    assert manifest["loss_weighting"] == {"name": "uncertainty"}
    loaded = HeadedModel.from_pretrained(tmp_path)
    assert {k: float(v.detach()) for k, v in loaded.loss_weighting.log_vars.items()} == moved


@pytest.mark.parametrize("scheme", ["fixed", "adaptive", "uncertainty"])
def test_heads_without_labels_in_a_batch_do_not_break_training(scheme: str) -> None:
    kwargs = {"warmup": 1} if scheme == "adaptive" else {}
    model = _model(scheme, **kwargs).train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    for step in range(4):
        batch = _batch(step, a=step % 2 == 0, b=step % 2 == 1)  # one head labelled per batch
        missing = "b" if "a" in batch else "a"
        out = model(**batch)
        assert missing not in out.loss_by_head and missing not in out.adapted_loss_by_head
        assert torch.isfinite(out.loss)
        opt.zero_grad()
        out.loss.backward()
        # the unlabelled head takes no part in the step: no gradient at all, so no optimizer
        # moves it (under DDP without find_unused_parameters it joins with an exact zero)
        for p in model.heads[missing].parameters():
            assert p.grad is None
        if scheme == "uncertainty":
            assert model.loss_weighting.log_vars[missing].grad is None
        before = [p.detach().clone() for p in model.heads[missing].parameters()]
        opt.step()
        for p, b in zip(model.heads[missing].parameters(), before):
            assert torch.equal(p, b)
    if scheme == "adaptive":  # each head's statistics only count batches with its labels
        assert model.loss_weighting.count.tolist() == [2.0, 2.0]
