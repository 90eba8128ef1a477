"""One rule for a head's labels (``label_rule``): the collator, feature caching, ``forward``
and the metrics all read the same labels the same way, and a target that one head would read
per example and another per position is refused when the model is built."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny

from headkit import (
    LOSSES,
    ConfigError,
    HeadConfig,
    HeadedCollator,
    HeadedModel,
    LossSpec,
    cache_features,
    train_heads_on_features,
)
from headkit.losses import LabelRule, label_rule, target_rules
from headkit.metrics import HeadMetric

pytestmark = pytest.mark.usefixtures("single_thread")

IDS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]  # unpadded examples of 5, 3, 4 tokens
LENGTHS = [len(x) for x in IDS]

#: (head, each example's label, the rule every reader must follow)
CASES = {
    "sequence": (
        HeadConfig("y", num_outputs=3, pred_for_sequence=True),
        [2, -100, 1],
        LabelRule("sequence", False, True, -100, torch.long, "classification", False),
    ),
    "token": (
        HeadConfig("y", num_outputs=4),
        [[0, 1, -100, 3, 2], [1, 1, 0], [3, -100, 2, 0]],
        LabelRule("token", False, True, -100, torch.long, "classification", True),
    ),
    "causal_lm": (
        HeadConfig("y", is_causal_lm=True),
        [ids[:2] + [-100] + ids[3:] for ids in IDS],
        LabelRule("token", True, True, -100, torch.long, "lm", False),
    ),
    "regression": (
        HeadConfig("y", pred_for_sequence=True, is_regression=True, loss_fct="mse"),
        [0.5, -1.5, 2.0],
        LabelRule("sequence", False, False, None, torch.float32, "regression", False),
    ),
}


def _counted(case: str, labels: list) -> list[tuple[int, int | None, float]]:
    """(example, position or None, label) of every label that counts, worked out by hand:
    -100 never counts, a causal-LM label at t + 1 meets the prediction at t."""
    out = []
    for i, y in enumerate(labels):
        if case in ("sequence", "regression"):
            if y != -100 or case == "regression":
                out.append((i, None, y))
        elif case == "token":
            out += [(i, t, v) for t, v in enumerate(y) if v != -100]
        else:  # causal_lm: prediction t, label t + 1
            out += [(i, t, y[t + 1]) for t in range(len(y) - 1) if y[t + 1] != -100]
    return out


def _expected_loss(case: str, preds: torch.Tensor, counted: list) -> torch.Tensor:
    rows = torch.stack([preds[i] if t is None else preds[i, t] for i, t, _ in counted])
    if case == "regression":
        return F.mse_loss(rows[:, 0], torch.tensor([v for *_, v in counted]))
    return F.cross_entropy(rows, torch.tensor([int(v) for *_, v in counted]))


@pytest.mark.parametrize("case", list(CASES))
def test_the_four_readers_agree(case):
    cfg, labels, rule = CASES[case]
    assert label_rule(cfg) == rule
    model = HeadedModel(build_tiny("gpt2"), [cfg]).eval()
    examples = [{"input_ids": ids, "y": y} for ids, y in zip(IDS, labels)]
    counted = _counted(case, labels)

    # the collator: one label per example, or per position padded with the ignore value
    collator = HeadedCollator(model)
    batch = collator(examples)
    assert collator.is_token_level("y", labels, LENGTHS) == (rule.layout == "token")
    y = batch["labels"]  # the one head with a loss: a plain tensor
    assert tuple(y.shape) == ((3, 5) if rule.layout == "token" else (3,))
    assert y.dtype == (torch.float32 if case == "regression" else torch.long)

    # forward: the loss over exactly the labels that count
    out = model(**batch)
    want = _expected_loss(case, out.preds_by_head["y"], counted)
    torch.testing.assert_close(out.loss_by_head["y"], want)

    # the metrics: the same labels counted
    meter = HeadMetric(model.head_configs["y"])
    assert meter.rule == rule and meter.kind == rule.task
    meter.update(out.preds_by_head["y"], y, batch["attention_mask"])
    seen = {
        "classification": lambda m: int(m.confusion.sum()),
        "lm": lambda m: m.tokens,
        "regression": lambda m: int(m.sums[0, 0]),
    }[rule.task](meter)
    assert seen == len(counted)
    if rule.task == "lm":
        assert meter.compute()["perplexity"] == pytest.approx(
            math.exp(float(want.detach())), rel=1e-5
        )

    # cached features: the labels stored in the same layout, the same loss from them
    cached = cache_features(model, examples, batch_size=2, progress=False)
    assert cached.meta["labels"]["y"]["layout"] == rule.layout
    stored = cached.labels["y"]
    if rule.layout == "token":
        assert stored.shape[0] == sum(LENGTHS)
        assert stored.tolist() == [v for row in labels for v in row]
    else:
        assert stored.tolist() == pytest.approx(labels)
    opt = torch.optim.SGD([p for p in model.heads.parameters()], lr=0.0)
    losses = train_heads_on_features(model, cached, batch_size=3, optimizer=opt)
    assert losses[0] == pytest.approx(float(want.detach()), rel=1e-5)


# ---------------------------------------------------------------------- one layout per target
@pytest.mark.parametrize("order", ["sequence first", "token first"])
def test_a_target_read_per_example_and_per_position_is_refused_when_the_model_is_built(order):
    seq = HeadConfig("mood", num_outputs=2, pred_for_sequence=True, target="shared")
    tok = HeadConfig("tags", num_outputs=5, target="shared")
    heads = [seq, tok] if order == "sequence first" else [tok, seq]
    with pytest.raises(
        ConfigError,
        match=r"target 'shared' is read by sequence head 'mood' \(one label per example\) and by "
        r"token head 'tags' \(one label per position\)",
    ):
        HeadedModel(build_tiny("gpt2"), heads)
    with pytest.raises(ConfigError, match=r"give one of the heads another target"):
        target_rules(heads)


def test_heads_sharing_a_target_in_one_layout_are_grouped():
    heads = [
        HeadConfig("next", is_causal_lm=True, target="ids"),
        HeadConfig("copy", num_outputs=100, target="ids"),
        HeadConfig("value", is_regression=True, loss_fct="mse", target="ids"),
    ]
    rules = target_rules(heads)
    assert list(rules) == ["ids"] and rules["ids"].layout == "token"
    assert [r.shift for r in rules["ids"].heads.values()] == [True, False, False]
    assert not rules["ids"].ignores_minus_100  # mse would train towards -100
    HeadedModel(build_tiny("gpt2"), heads)  # one layout: built


# ---------------------------------------------------------------------- readers that guessed
def test_the_collator_follows_the_rule_where_the_shape_would_say_otherwise():
    """Three values per example of three tokens look like token labels; the head says one
    row per example."""
    cfg = HeadConfig("v", num_outputs=3, pred_for_sequence=True, is_regression=True, loss_fct="mse")
    model = HeadedModel(build_tiny("gpt2"), [cfg])
    examples = [
        {"input_ids": [5, 6, 7], "v": [0.1, 0.2, 0.3]},
        {"input_ids": [8, 9, 10], "v": [1.0, 2.0, 3.0]},
    ]
    batch = HeadedCollator(model)(examples)
    assert batch["labels"].shape == (2, 3)
    assert not HeadedCollator(model).is_token_level("v", [e["v"] for e in examples], [3, 3])
    assert HeadedCollator().is_token_level(
        "v", [e["v"] for e in examples], [3, 3]
    )  # no model: a guess
    torch.testing.assert_close(
        model(**batch).loss, F.mse_loss(model(**batch).preds_by_head["v"], batch["labels"])
    )
    with pytest.raises(
        ConfigError, match=r"token_targets names \['v'\], which the model's heads read"
    ):
        HeadedCollator(model, token_targets=["v"])


@pytest.fixture
def plain_ce():
    spec = LossSpec(
        lambda p, y: F.cross_entropy(p, y, reduction="none", ignore_index=-100), classes=True
    )
    LOSSES.register("plain_ce_test", spec)
    yield "plain_ce_test"
    LOSSES.remove("plain_ce_test")


def test_class_indices_skip_minus_100_in_every_reader(plain_ce):
    """A class loss registered without ``ignores_minus_100``: no class is negative, so -100 is
    skipped by its loss, filled in by the collator and left out of its metrics alike."""
    cfg = HeadConfig("c", num_outputs=3, pred_for_sequence=True, loss_fct=plain_ce)
    assert label_rule(cfg).ignore_index == -100
    model = HeadedModel(build_tiny("gpt2"), [cfg]).eval()
    batch = HeadedCollator(model)(
        [{"input_ids": [5, 6], "c": 2}, {"input_ids": [7, 8]}]
    )  # one missing
    assert batch["labels"].tolist() == [2, -100]
    out = model(**batch)
    torch.testing.assert_close(
        out.loss, F.cross_entropy(out.preds_by_head["c"][:1], batch["labels"][:1])
    )
    meter = HeadMetric(model.head_configs["c"]).update(out.preds_by_head["c"], batch["labels"])
    assert int(meter.confusion.sum()) == 1


def test_a_loss_spec_whose_metric_contradicts_its_labels_is_refused():
    with pytest.raises(ConfigError, match=r"metric='binary' does not fit classes=True"):
        LossSpec(lambda p, y: p, classes=True, metric="binary")
    with pytest.raises(ConfigError, match=r"metric='classification' does not fit classes=False"):
        LossSpec(lambda p, y: p, metric="classification")
