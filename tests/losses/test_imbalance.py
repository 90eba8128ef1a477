"""Imbalance and calibration: class weights and ``pos_weight`` give torch's own weighted losses,
the focal loss is the reference formula, each option is validated and saved with the head;
temperature scaling and the threshold are fitted on validation data and used by predictions
and metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny
from sklearn.utils.class_weight import compute_class_weight

from headkit import ConfigError, HeadConfig, HeadedModel, calibrate
from headkit.calibration import choose_threshold, fit_calibration
from headkit.losses.objective import LOSSES, decisions, head_loss, probabilities
from headkit.metrics import HeadMetric

pytestmark = pytest.mark.usefixtures("single_thread")


def _seq(**fields) -> HeadConfig:
    return HeadConfig("h", pred_for_sequence=True, **fields)


# ---------------------------------------------------------------------- weighted losses
def test_class_weights_give_torchs_weighted_cross_entropy() -> None:
    g = torch.Generator().manual_seed(0)
    weights = [1.0, 2.5, 0.25]
    cfg = _seq(num_outputs=3, class_weights=weights)
    p = torch.randn(16, 3, generator=g)
    y = torch.randint(0, 3, (16,), generator=g)
    y[3] = -100  # ignored: counts in neither sum
    expected = F.cross_entropy(p, y, weight=torch.tensor(weights))
    assert torch.allclose(head_loss(cfg, p, y, None), expected, atol=1e-6)
    # a token head: padding and -100 do not count, the rest is torch's weighted mean
    token = HeadConfig("t", num_outputs=3, class_weights=weights)
    p = torch.randn(2, 5, 3, generator=g)
    y = torch.randint(0, 3, (2, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    counted = torch.where(mask.bool(), y, -100)
    expected = F.cross_entropy(p.reshape(-1, 3), counted.reshape(-1), weight=torch.tensor(weights))
    assert torch.allclose(head_loss(token, p, y, mask), expected, atol=1e-6)


def test_pos_weight_gives_torchs_bce_with_logits() -> None:
    g = torch.Generator().manual_seed(1)
    p = torch.randn(12, 2, generator=g)
    y = torch.randint(0, 2, (12, 2), generator=g).float()
    for pos_weight in (3.0, [3.0, 0.5]):
        cfg = _seq(num_outputs=2, loss_fct="bce_with_logits", pos_weight=pos_weight)
        reference = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor(pos_weight))
        assert torch.allclose(head_loss(cfg, p, y, None), reference(p, y), atol=1e-6)
    y[0, 0] = -100  # an ignored element: the mean over the others
    cfg = _seq(num_outputs=2, loss_fct="bce_with_logits", pos_weight=[3.0, 0.5])
    per = F.binary_cross_entropy_with_logits(
        p, y.clamp(min=0), pos_weight=torch.tensor([3.0, 0.5]), reduction="none"
    )
    expected = per.reshape(-1)[1:].mean()
    assert torch.allclose(head_loss(cfg, p, y, None), expected, atol=1e-6)


def test_focal_loss_is_the_reference_formula() -> None:
    assert "focal" in LOSSES
    g = torch.Generator().manual_seed(2)
    p = torch.randn(20, 4, generator=g) * 3
    y = torch.randint(0, 4, (20,), generator=g)
    prob = torch.softmax(p.double(), -1)[torch.arange(20), y]
    for gamma in (0.0, 0.5, 2.0, 5.0):
        cfg = _seq(num_outputs=4, loss_fct="focal", loss_options={"gamma": gamma})
        reference = (-((1 - prob) ** gamma) * prob.log()).mean()
        assert torch.allclose(head_loss(cfg, p, y, None).double(), reference, atol=1e-5)
    default = _seq(num_outputs=4, loss_fct="focal")  # gamma 2 by default
    assert torch.allclose(
        head_loss(default, p, y, None).double(),
        (-((1 - prob) ** 2) * prob.log()).mean(),
        atol=1e-5,
    )
    zero = _seq(num_outputs=4, loss_fct="focal", loss_options={"gamma": 0})
    assert torch.allclose(head_loss(zero, p, y, None), F.cross_entropy(p, y), atol=1e-6)
    # class weights: the weighted mean, as cross_entropy(weight=) normalises
    w = torch.tensor([1.0, 3.0, 0.5, 2.0])
    weighted = _seq(num_outputs=4, loss_fct="focal", class_weights=w.tolist())
    per = -((1 - prob) ** 2) * prob.log()
    expected = (w[y].double() * per).sum() / w[y].sum()
    assert torch.allclose(head_loss(weighted, p, y, None).double(), expected, atol=1e-5)


def test_balanced_class_weights_are_sklearns() -> None:
    labels = [0] * 70 + [1] * 25 + [2] * 5
    cfg = _seq(num_outputs=3, class_weights="balanced")
    resolved = cfg.with_class_weights(labels)
    expected = compute_class_weight("balanced", classes=np.arange(3), y=np.array(labels))
    assert resolved.class_weights == pytest.approx(expected.tolist())
    with pytest.raises(ConfigError, match=r"class_weights='balanced' is not resolved yet"):
        head_loss(cfg, torch.randn(2, 3), torch.tensor([0, 1]), None)


@pytest.mark.parametrize(
    "fields, match",
    [
        (
            dict(num_outputs=1, is_regression=True, loss_fct="mse", class_weights=[1.0]),
            r"class_weights=\[1.0\] is invalid; class weights apply to a loss over class indices",
        ),
        (dict(num_outputs=3, class_weights=[1.0, 2.0]), r"one per output \(3\)"),
        (dict(num_outputs=2, class_weights=[1.0, -1.0]), r"class_weights=\[1.0, -1.0\] is invalid"),
        (dict(num_outputs=2, class_weights=[0, 0]), r"not all 0"),
        (dict(num_outputs=2, class_weights="equal"), r"class_weights='equal' is invalid"),
        (
            dict(num_outputs=2, pos_weight=2.0),
            r"pos_weight=2.0 is invalid; pos_weight applies "
            r"to bce_with_logits; loss_fct='cross_entropy'",
        ),
        (
            dict(num_outputs=2, loss_fct="bce_with_logits", pos_weight=0.0),
            r"pos_weight=0.0 is invalid; expected a finite number > 0",
        ),
        (
            dict(num_outputs=2, loss_fct="bce_with_logits", pos_weight=[1.0, float("nan")]),
            r"pos_weight=\[1.0, nan\] is invalid",
        ),
        (
            dict(num_outputs=2, loss_fct="focal", loss_options={"alpha": 1}),
            r"loss_options\['alpha'\]=1 is invalid; allowed options: gamma",
        ),
        (
            dict(num_outputs=2, loss_options={"gamma": 1}),
            r"allowed options: none \(this loss takes no options\)",
        ),
        (
            dict(num_outputs=2, loss_fct="focal", loss_options={"gamma": -1}),
            r"loss_options\['gamma'\]=-1 is invalid; expected a finite number >= 0",
        ),
        (dict(num_outputs=2, temperature=0), r"temperature=0 is invalid; expected a finite"),
        (dict(num_outputs=2, threshold=1.5), r"threshold=1.5 is invalid; expected a probability"),
        (
            dict(num_outputs=3, threshold=0.3),
            r"threshold=0.3 is invalid; a decision threshold "
            r"applies to binary heads",
        ),
    ],
)
def test_bad_weights_and_calibration_name_field_value_and_allowed(fields, match) -> None:
    with pytest.raises(ConfigError, match=match):
        _seq(**fields)


def test_options_are_saved_and_loaded_with_the_checkpoint(tmp_path) -> None:
    heads = [
        _seq(
            num_outputs=3,
            loss_fct="focal",
            loss_options={"gamma": 1.5},
            class_weights=[1.0, 2.0, 3.0],
            temperature=1.7,
        ),
        HeadConfig(
            "b",
            pred_for_sequence=True,
            num_outputs=1,
            loss_fct="bce_with_logits",
            pos_weight=4.0,
            threshold=0.3,
        ),
    ]
    HeadedModel(build_tiny("bert"), heads).save_pretrained(tmp_path / "ckpt")
    loaded = HeadedModel.from_pretrained(tmp_path / "ckpt")
    for cfg in heads:
        got = loaded.head_configs[cfg.name]
        for field in (
            "loss_fct",
            "loss_options",
            "class_weights",
            "pos_weight",
            "temperature",
            "threshold",
        ):
            assert getattr(got, field) == getattr(cfg, field), field


# ---------------------------------------------------------------------- calibration
def test_temperature_scaling_recovers_an_overconfidence() -> None:
    g = torch.Generator().manual_seed(3)
    true = torch.randn(4000, 3, generator=g)
    labels = torch.multinomial(torch.softmax(true, -1), 1, generator=g)[:, 0]
    cfg = _seq(num_outputs=3)
    got = fit_calibration(cfg, true * 4.0, labels)  # four times too confident
    assert got.temperature == pytest.approx(4.0, rel=0.1)
    assert got.nll_after < got.nll_before
    calibrated = cfg.replace(temperature=got.temperature)
    assert torch.allclose(
        probabilities(calibrated, true * 4.0), torch.softmax(true * 4.0 / got.temperature, -1)
    )


def test_threshold_maximises_f1_or_accuracy() -> None:
    g = torch.Generator().manual_seed(4)
    prob = torch.rand(300, generator=g)
    truth = torch.rand(300, generator=g) < prob * 0.6  # positives rare: the best cut is low
    for metric in ("f1", "accuracy"):
        cut = choose_threshold(prob, truth, metric)
        scores = []
        for c in torch.linspace(0.001, 0.999, 999):
            hat = prob >= c
            tp, fp = int((hat & truth).sum()), int((hat & ~truth).sum())
            fn = int((~hat & truth).sum())
            f1 = 2 * tp / max(2 * tp + fp + fn, 1)
            scores.append(f1 if metric == "f1" else float((hat == truth).float().mean()))
        hat = prob >= cut
        tp, fp, fn = int((hat & truth).sum()), int((hat & ~truth).sum()), int((~hat & truth).sum())
        mine = (
            2 * tp / max(2 * tp + fp + fn, 1)
            if metric == "f1"
            else float((hat == truth).float().mean())
        )
        assert mine >= max(scores) - 1e-9


def test_calibrate_writes_the_head_configs_and_predictions_use_them(tmp_path) -> None:
    torch.manual_seed(0)
    model = HeadedModel(
        build_tiny("bert"),
        [
            _seq(num_outputs=2),
            HeadConfig("flag", pred_for_sequence=True, num_outputs=1, loss_fct="bce_with_logits"),
        ],
    )
    with torch.no_grad():
        for head in model.heads.values():
            head.linears[0].weight.mul_(40)  # overconfident random heads
    g = torch.Generator().manual_seed(5)
    examples = [
        {
            "input_ids": torch.randint(5, 90, (6,), generator=g).tolist(),
            "h": int(i % 3 == 0),
            "flag": [float(i % 4 == 0)],
        }
        for i in range(48)
    ]
    fitted = calibrate(model, examples, threshold="f1")
    assert set(fitted) == {"h", "flag"}
    for name, got in fitted.items():
        cfg = model.head_configs[name]
        assert cfg.temperature == got.temperature > 1  # overconfident: T > 1
        assert cfg.threshold == got.threshold is not None
        assert model.heads[name].config is cfg
        assert got.nll_after <= got.nll_before
    p = torch.tensor([[0.0, 0.4], [2.0, 0.0]])
    cfg = model.head_configs["h"]
    expected = (torch.softmax(p / cfg.temperature, -1)[:, 1] >= cfg.threshold).long()
    assert torch.equal(decisions(cfg, p), expected)
    model.save_pretrained(tmp_path / "calibrated")
    again = HeadedModel.from_pretrained(tmp_path / "calibrated").head_configs["h"]
    assert (again.temperature, again.threshold) == (cfg.temperature, cfg.threshold)


def test_metrics_decide_with_the_heads_threshold() -> None:
    cfg = HeadConfig("b", pred_for_sequence=True, num_outputs=1, loss_fct="bce_with_logits")
    logits = torch.tensor([[-2.0], [-0.5], [0.5], [2.0]])
    labels = torch.tensor([[0.0], [1.0], [1.0], [1.0]])
    default = HeadMetric(cfg).update(logits, labels).compute()
    assert default["accuracy"] == 0.75  # cut at logit 0 (probability 0.5)
    low = HeadMetric(cfg.replace(threshold=0.3)).update(logits, labels).compute()
    assert low["accuracy"] == 1.0  # sigmoid(-0.5) = 0.38 >= 0.3: positive


def test_calibrate_refuses_an_unknown_threshold_metric() -> None:
    model = HeadedModel(build_tiny("bert"), [_seq(num_outputs=2)])
    with pytest.raises(ConfigError, match=r"threshold='youden' is invalid; allowed: f1, accuracy"):
        calibrate(model, [{"input_ids": [5, 6, 7], "h": 1}], threshold="youden")
