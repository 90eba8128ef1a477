"""Heads that share labels and a stackable loss run it as one call (``losses.shared``): each
head's loss and the gradient that reaches its predictions are, bit for bit, what the head
gets alone (``head_loss``). Heads that cannot share compute alone, with the same result."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny

from headkit import HeadConfig, HeadedModel
from headkit.losses import LOSSES, LossSpec, head_loss
from headkit.losses import shared as shared_losses
from headkit.losses.shared import head_losses

STACKABLE = ("cross_entropy", "mse", "masked_mse", "l1", "smooth_l1")
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


def _heads(loss: str, layout: str, n: int = 3, **kw) -> dict[str, HeadConfig]:
    classes = LOSSES.get(loss).classes
    return {
        f"h{i}": HeadConfig(
            f"h{i}",
            in_size=4,
            num_outputs=5 if classes else 2,
            target="y",
            loss_fct=loss,
            is_regression=not classes,
            pred_for_sequence=layout == "sequence",
            **kw,
        )
        for i in range(n)
    }


def _data(cfg: HeadConfig, batch: int, seq: int, gen: torch.Generator):
    """Labels with skipped (-100) entries where the loss skips them, and a padded mask."""
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq // 2 :] = 0
    shape = (batch,) if cfg.pred_for_sequence else (batch, seq)
    spec = LOSSES.get(cfg.loss_fct)
    if spec.classes:
        y = torch.randint(0, cfg.num_outputs, shape, generator=gen)
    else:
        y = torch.randn(*shape, cfg.num_outputs, generator=gen)
    if spec.ignores_minus_100:
        y.view(-1)[::3] = -100
    return y, mask


def _same_as_alone(configs, batch, seq, dtype, device, gen) -> None:
    first = next(iter(configs.values()))
    y, mask = _data(first, batch, seq, gen)
    y, mask = y.to(device), mask.to(device)
    lead = (batch,) if first.pred_for_sequence else (batch, seq)
    preds = {
        n: torch.randn(*lead, c.num_outputs, generator=gen).to(device, dtype).requires_grad_()
        for n, c in configs.items()
    }
    weights = {n: 0.5 + i for i, n in enumerate(configs)}
    together = head_losses(configs, preds, {"y": y}, dict.fromkeys(configs, mask))
    assert list(together) == list(configs)
    sum(weights[n] * v for n, v in together.items()).backward()
    for name, cfg in configs.items():
        alone_p = preds[name].detach().clone().requires_grad_()
        alone = head_loss(cfg, alone_p, y, mask)
        (weights[name] * alone).backward()
        assert torch.equal(together[name], alone), (name, together[name], alone)
        assert torch.equal(preds[name].grad, alone_p.grad), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["sequence", "token"])
@pytest.mark.parametrize("loss", STACKABLE)
def test_heads_in_one_loss_call_get_exactly_their_own_loss_and_gradient(
    loss: str, layout: str, dtype: torch.dtype, device: str, monkeypatch
) -> None:
    calls = []
    stacked = shared_losses.stacked_losses
    monkeypatch.setattr(
        shared_losses, "stacked_losses", lambda *a: calls.append(len(a[1])) or stacked(*a)
    )
    gen = torch.Generator().manual_seed(0)
    # rows per head: 5 and 35 (padded to 128), 128 and 256 (none), 3000, and 80000 (more
    # than one thread's share of a sum: ``sum(dim=1)`` would add in another order there)
    for batch, seq in ((5, 7), (16, 8), (32, 8), (60, 50), (40000, 2)):
        _same_as_alone(_heads(loss, layout), batch, seq, dtype, device, gen)
    assert calls == [3] * 5  # one call for the three heads, each time


def test_many_heads_and_wide_rows_stay_exact() -> None:
    gen = torch.Generator().manual_seed(1)
    for classes in (1, 2, 1000):
        configs = {
            f"s{i}": HeadConfig(f"s{i}", in_size=4, num_outputs=classes, target="y",
                                pred_for_sequence=True)
            for i in range(25)
        }  # fmt: skip
        _same_as_alone(configs, 8, 4, torch.float32, "cpu", gen)


@pytest.mark.parametrize(
    "kw",
    [
        {"loss": "bce_with_logits"},  # exp and log element-wise: a vector lane and the
        {"loss": "bce"},  # scalar tail may round differently, so these compute alone
        {"loss": "focal"},
        {"loss": "cross_entropy", "class_weights": [1.0, 2.0, 1.0, 0.5, 1.0]},
        {"loss": "bce_with_logits", "pos_weight": [2.0, 0.5]},
        {"loss": "cross_entropy", "is_causal_lm": True},
    ],
)
def test_heads_that_cannot_share_a_call_compute_alone_with_the_same_result(kw, monkeypatch):
    monkeypatch.setattr(shared_losses, "stacked_losses", None)  # never called
    loss = kw.pop("loss")
    layout = "token" if kw.get("is_causal_lm") else "sequence"
    if loss == "bce":
        kw["output_activation"] = "sigmoid"
    configs = _heads(loss, layout, **kw)
    gen = torch.Generator().manual_seed(2)
    first = next(iter(configs.values()))
    y, mask = _data(first, 6, 5, gen)
    if loss == "bce":
        y = torch.where(y == -100, y, y.sigmoid())
    if loss in ("bce", "bce_with_logits"):
        y = torch.where(y == -100, y, y.clamp(0, 1))
    lead = (6,) if first.pred_for_sequence else (6, 5)
    preds = {n: torch.randn(*lead, c.num_outputs, generator=gen) for n, c in configs.items()}
    if loss == "bce":
        preds = {n: p.sigmoid() for n, p in preds.items()}
    together = head_losses(configs, preds, {"y": y}, dict.fromkeys(configs, mask))
    for name, cfg in configs.items():
        assert torch.equal(together[name], head_loss(cfg, preds[name], y, mask)), name


def test_heads_with_different_options_or_dtypes_do_not_share_a_call(monkeypatch) -> None:
    calls = []
    stacked = shared_losses.stacked_losses
    monkeypatch.setattr(
        shared_losses, "stacked_losses", lambda *a: calls.append(len(a[1])) or stacked(*a)
    )
    spec = LossSpec(lambda p, y, scale=1.0: scale * (p - y).abs(), options={"scale": 1.0},
                    stackable=True)  # fmt: skip
    LOSSES.register("scaled_l1_test", spec)
    try:

        def head(name: str, **kw) -> HeadConfig:
            return HeadConfig(name, in_size=4, num_outputs=2, target="y", is_regression=True,
                              loss_fct="scaled_l1_test", pred_for_sequence=True, **kw)  # fmt: skip

        configs = {
            "a": head("a"),
            "b": head("b", loss_options={"scale": 1.0}),  # a's options: shares a's call
            "c": head("c", loss_options={"scale": 0.5}),
            "d": head("d"),  # float64 predictions below
        }
        gen = torch.Generator().manual_seed(3)
        preds = {n: torch.randn(4, 2, generator=gen) for n in configs}
        preds["d"] = preds["d"].double()
        y = torch.randn(4, 2, generator=gen)
        together = head_losses(configs, preds, {"y": y}, dict.fromkeys(configs))
        for name, cfg in configs.items():
            assert torch.equal(together[name], head_loss(cfg, preds[name], y, None)), name
    finally:
        LOSSES.remove("scaled_l1_test")
    assert calls == [2]  # a and b (the same options once resolved); c and d compute alone


def test_a_skipped_non_finite_loss_sends_nothing_back_into_its_head() -> None:
    """``nonfinite_loss="skip"``: the heads compute their losses alone, so a head whose loss is
    NaN gets no gradient (in one call its rows' backward would turn the zero gradient into
    NaN) and the others get exactly what they get without it; under "raise" they share."""

    def heads(names):
        return [HeadConfig(n, num_outputs=2, pred_for_sequence=True, pooling="mean", target="y")
                for n in names]  # fmt: skip

    backbone = build_tiny("gpt2", num_layers=2)
    batch = {"input_ids": torch.randint(3, 90, (4, 6), generator=torch.Generator().manual_seed(0)),
             "y": torch.tensor([0, 1, 1, 0])}  # fmt: skip
    model = HeadedModel(backbone, heads(["a", "bad", "c"]), nonfinite_loss="skip").train()
    with torch.no_grad():
        model.heads["bad"].linears[0].weight.fill_(float("nan"))
    with pytest.warns(UserWarning, match="head 'bad': non-finite loss skipped"):
        model(**batch).loss.backward()
    assert model.heads["bad"].linears[0].weight.grad is None
    alone = HeadedModel(build_tiny("gpt2", num_layers=2), heads(["a", "c"])).train()
    alone.heads.load_state_dict({k: v for k, v in model.heads.state_dict().items()
                                 if not k.startswith("bad.")})  # fmt: skip
    alone(**batch).loss.backward()
    for name in ("a", "c"):
        got = model.heads[name].linears[0].weight.grad
        assert torch.equal(got, alone.heads[name].linears[0].weight.grad), name


@pytest.mark.parametrize(
    ("kw", "shared"),
    [
        ({}, [3]),  # frozen backbone, parameter-free pooling: one call
        ({"freeze_base_model": False}, []),  # inputs need a gradient: each head alone
        ({"nonfinite_loss": "skip"}, []),
    ],
)
def test_the_model_shares_a_call_only_where_gradients_cannot_change(kw, shared, monkeypatch):
    calls = []
    stacked = shared_losses.stacked_losses
    monkeypatch.setattr(
        shared_losses, "stacked_losses", lambda *a: calls.append(len(a[1])) or stacked(*a)
    )
    heads = [HeadConfig(n, num_outputs=2, pred_for_sequence=True, pooling="mean", target="y")
             for n in "abc"]  # fmt: skip
    model = HeadedModel(build_tiny("bert", num_layers=2), heads, **kw).train()
    ids = torch.randint(3, 90, (4, 6), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, y=torch.tensor([0, 1, 1, 0])).loss.backward()
    assert calls == shared
