"""What headkit asks a head, never its attributes: the output projection (tying, resizing), the
Linear layers it is made of (export) and its size from the config (the size guards).

A head kind registered by a user, with parameters of its own and no Linear at all, works
wherever an MLP head does: named ``lm_head`` with ``is_causal_lm=True`` on a GPT-2 task
model it is built, trains, and comes back from a checkpoint with identical predictions.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import HIDDEN, PAD, VOCAB, build_tiny
from torch import nn

from headkit import (
    HEADS,
    POOLINGS,
    CheckpointError,
    ConfigError,
    Head,
    HeadConfig,
    HeadedModel,
    MLPHead,
    PoolingStrategy,
)
from headkit.checkpoint import MANIFEST, read_checkpoint
from headkit.integrations.sentence_transformers import _exportable

pytestmark = pytest.mark.usefixtures("single_thread")

IDS = torch.tensor([[PAD, PAD, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])


class LowRankHead(Head):
    """A head kind of a test: features @ down @ up, two Parameters and no Linear."""

    def __init__(self, config, pooler_size=None, pooler=None):
        super().__init__(config, pooler_size, pooler)
        rank = config.extra.get("rank", 4)
        g = torch.Generator().manual_seed(3)
        self.down = nn.Parameter(torch.randn(self.in_features, rank, generator=g) * 0.3)
        self.up = nn.Parameter(torch.randn(rank, config.num_outputs, generator=g) * 0.3)
        self.requires_grad_(config.trainable)

    def from_features(self, features):
        return features @ self.down @ self.up


class GatedLinearHead(Head):
    """A head kind whose output projection is a Linear, after a learned gate."""

    def __init__(self, config, pooler_size=None, pooler=None):
        super().__init__(config, pooler_size, pooler)
        self.gate = nn.Parameter(torch.ones(self.in_features))
        self.proj = nn.Linear(self.in_features, config.num_outputs)

    def from_features(self, features):
        return self.proj(features * self.gate)

    def output_projection(self):
        return self.proj

    @classmethod
    def parameter_count(cls, config, pooler_size=None):
        width = cls.pooled_width(config, pooler_size)
        return width + (width + 1) * config.num_outputs + cls.pooling_parameter_count(config)


@pytest.fixture
def kinds():
    HEADS.register("low_rank_test", LowRankHead)
    HEADS.register("gated_linear_test", GatedLinearHead)
    yield
    HEADS.remove("low_rank_test")
    HEADS.remove("gated_linear_test")


def _train(model: HeadedModel, steps: int = 5, **labels) -> list[float]:
    params = [p for p in model.heads.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5)
    model.train()
    losses = []
    for _ in range(steps):
        out = model(input_ids=IDS, attention_mask=MASK, **labels)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    return losses


# ---------------------------------------------------------------------- a user's kind
def test_a_registered_kind_named_lm_head_builds_trains_and_round_trips(kinds, tmp_path):
    cfg = HeadConfig("lm_head", is_causal_lm=True, head_type="low_rank_test", extra={"rank": 3})
    task_model = build_tiny("gpt2")
    model = HeadedModel(task_model, [cfg])  # a GPT2LMHeadModel: its LM head is no start here
    head = model.heads["lm_head"]
    assert isinstance(head, LowRankHead) and head.output_projection() is None
    assert not head.projection_only and not any(
        p is task_model.lm_head.weight for p in head.parameters()
    )
    before = head.up.detach().clone()
    losses = _train(model, lm_head=IDS)
    assert losses[-1] < losses[0] and not torch.equal(head.up, before)
    model.eval()
    want = model(input_ids=IDS, attention_mask=MASK).preds_by_head["lm_head"]
    assert want.shape == (2, 6, VOCAB)
    model.save_pretrained(tmp_path / "ckpt")
    again = HeadedModel.from_pretrained(tmp_path / "ckpt").eval()
    assert isinstance(again.heads["lm_head"], LowRankHead)
    got = again(input_ids=IDS, attention_mask=MASK).preds_by_head["lm_head"]
    assert torch.equal(got, want)


def test_a_registered_kind_with_a_regular_name_round_trips(kinds, tmp_path):
    cfg = HeadConfig(
        "mood",
        num_outputs=3,
        pred_for_sequence=True,
        pooling="mean+attention",
        head_type="low_rank_test",
    )
    model = HeadedModel(build_tiny("llama"), [cfg])
    assert model.heads["mood"].in_features == 2 * HIDDEN  # mean + attention, each its width
    losses = _train(model, mood=torch.tensor([0, 2]))
    assert losses[-1] < losses[0]
    model.eval()
    want = model(input_ids=IDS, attention_mask=MASK).preds_by_head["mood"]
    model.save_pretrained(tmp_path / "ckpt")
    again = HeadedModel.from_pretrained(tmp_path / "ckpt").eval()
    assert torch.equal(again(input_ids=IDS, attention_mask=MASK).preds_by_head["mood"], want)


def test_a_kind_with_an_output_projection_starts_from_the_lm_head_only_if_it_is_nothing_else(
    kinds,
):
    task_model = build_tiny("gpt2")
    gated = HeadedModel(
        task_model, [HeadConfig("lm_head", is_causal_lm=True, head_type="gated_linear_test")]
    )
    proj = gated.heads["lm_head"].output_projection()
    assert proj is gated.heads["lm_head"].proj and not gated.heads["lm_head"].projection_only
    assert not torch.equal(proj.weight, task_model.lm_head.weight)  # a gate too: not the LM head
    frozen = HeadConfig("lm_head", is_causal_lm=True, trainable=False)
    one = HeadedModel(build_tiny("gpt2"), [frozen])
    assert one.heads["lm_head"].projection_only  # a one-layer MLP head: it is its projection
    assert one.heads["lm_head"].output_projection().weight is one.backbone.wte.weight  # tied
    deep = frozen.replace(num_layers=2, hidden_size=HIDDEN)  # its last Linear fits the LM head
    two = HeadedModel(build_tiny("gpt2"), [deep])
    last = two.heads["lm_head"].output_projection()
    assert not two.heads["lm_head"].projection_only and last is two.heads["lm_head"].linears[-1]
    assert last.weight is not two.backbone.wte.weight
    assert not torch.equal(last.weight, two.backbone.wte.weight)  # not started from the LM head


# ---------------------------------------------------------------------- resizing
def test_resizing_follows_any_output_projection_and_refuses_a_head_without_one(kinds):
    gated = HeadedModel(
        build_tiny("gpt2"),
        [HeadConfig("lm_head", is_causal_lm=True, head_type="gated_linear_test")],
    )
    old = gated.heads["lm_head"].proj.weight.detach().clone()
    gated.resize_token_embeddings(VOCAB + 10)
    proj = gated.heads["lm_head"].output_projection()
    assert proj.out_features == VOCAB + 10 and torch.equal(proj.weight[:VOCAB], old)
    assert gated.head_configs["lm_head"].num_outputs == VOCAB + 10
    assert gated(input_ids=IDS).preds_by_head["lm_head"].shape == (2, 6, VOCAB + 10)

    low = HeadedModel(
        build_tiny("gpt2"), [HeadConfig("lm_head", is_causal_lm=True, head_type="low_rank_test")]
    )
    with pytest.raises(
        ConfigError, match=r"head 'lm_head' \(LowRankHead\) predicts the vocabulary"
    ):
        low.resize_token_embeddings(VOCAB + 10)
    assert low.get_input_embeddings().weight.shape[0] == VOCAB  # refused before resizing


# ---------------------------------------------------------------------- export
def test_export_asks_the_head_for_its_linear_layers(kinds):
    heads = [
        HeadConfig(
            "mlp",
            num_outputs=2,
            pred_for_sequence=True,
            pooling="mean",
            num_layers=2,
            hidden_size=8,
            hidden_activation="gelu",
            output_activation="tanh",
        ),
        HeadConfig(
            "low", num_outputs=2, pred_for_sequence=True, pooling="mean", head_type="low_rank_test"
        ),
    ]
    model = HeadedModel(build_tiny("bert"), heads)
    _, mode, layers = _exportable(model, "mlp")
    assert mode == "mean"
    assert [lin for lin, _ in layers] == model.heads["mlp"].linears
    assert [type(act) for _, act in layers] == [nn.GELU, nn.Tanh]
    with pytest.raises(
        ConfigError, match=r"head 'low' is a LowRankHead, which is not a chain of Linear"
    ):
        _exportable(model, "low")


# ---------------------------------------------------------------------- sizes
@pytest.mark.parametrize(
    "arch, cfg",
    [
        ("gpt2", HeadConfig("t", num_outputs=5)),
        ("gpt2", HeadConfig("t", num_outputs=5, num_layers=3, hidden_size=7, output_bias=True)),
        (
            "gpt2",
            HeadConfig("s", num_outputs=2, pred_for_sequence=True, pooling="mean+max+attention"),
        ),
        (
            "bert",
            HeadConfig(
                "p",
                num_outputs=3,
                pred_for_sequence=True,
                pooling="pooler+first",
                num_layers=2,
                hidden_size=4,
            ),
        ),
        ("gpt2", HeadConfig("lm", is_causal_lm=True)),
    ],
    ids=["one-linear", "three-layers", "concatenated-poolings", "backbone-pooler", "lm"],
)
def test_an_mlp_head_counts_its_parameters_and_tensors_without_being_built(arch, cfg):
    model = HeadedModel(build_tiny(arch), [cfg])
    head, resolved = model.heads[cfg.name], model.head_configs[cfg.name]
    built = sum(p.numel() for p in head.parameters())
    assert MLPHead.parameter_count(resolved, model.info.pooler_size) == built
    assert MLPHead.tensor_count(resolved) == resolved.num_layers == len(head.linears)
    assert Head.pooled_width(resolved, model.info.pooler_size) == head.in_features


def test_the_construction_guard_asks_a_kind_for_its_count_or_builds_it_on_meta(kinds):
    gated = HeadConfig("g", num_outputs=10**9, head_type="gated_linear_test")
    with pytest.raises(ConfigError, match=r"makes a head of 33,000,000,032 parameters"):
        HeadedModel(build_tiny("gpt2"), [gated])
    low = HeadConfig("l", num_outputs=1000, head_type="low_rank_test", extra={"rank": 8})
    with pytest.raises(
        ConfigError, match=r"makes a head of 8,256 parameters.*limit max_head_parameters=8,000"
    ):
        HeadedModel(build_tiny("gpt2"), [low], max_head_parameters=8000)  # counted on meta
    HeadedModel(build_tiny("gpt2"), [low], max_head_parameters=8256)


def test_the_checkpoint_guard_counts_each_kind_by_its_own_rule(kinds, tmp_path):
    heads = [
        HeadConfig("g", num_outputs=3, head_type="gated_linear_test"),
        HeadConfig("l", num_outputs=3, head_type="low_rank_test"),
    ]
    HeadedModel(build_tiny("gpt2"), heads).save_pretrained(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / MANIFEST).read_text())
    read_checkpoint(tmp_path / "ckpt")  # as saved: it fits
    manifest["heads"][1]["num_outputs"] = 10**9  # a kind that cannot count itself: not judged
    (tmp_path / "ckpt" / MANIFEST).write_text(json.dumps(manifest))
    read_checkpoint(tmp_path / "ckpt")
    manifest["heads"][0]["num_outputs"] = 10**9  # the gated kind counts 33e9 + 32 parameters
    (tmp_path / "ckpt" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(
        CheckpointError, match=r"describes heads with at least 33000000032 parameters"
    ):
        read_checkpoint(tmp_path / "ckpt")


# ---------------------------------------------------------------------- poolings
class MeanAndLength(PoolingStrategy):
    """A strategy of a test, one wider than the states: the mean and log(1 + length)."""

    @classmethod
    def width(cls, hidden_size, pooler_size=None):
        return hidden_size + 1

    def forward(self, hidden, mask):
        keep = mask.bool().unsqueeze(-1)
        n = keep.sum(1).clamp(min=1)
        mean = torch.where(keep, hidden, 0.0).sum(1) / n
        return torch.cat([mean, torch.log1p(n.to(hidden.dtype))], -1)


def test_each_pooling_reports_its_own_width_and_heads_follow():
    POOLINGS.register("mean_and_length_test", MeanAndLength)
    try:
        cfg = HeadConfig(
            "s", num_outputs=2, pred_for_sequence=True, pooling="mean_and_length_test+max"
        )
        model = HeadedModel(build_tiny("gpt2"), [cfg]).eval()
        head = model.heads["s"]
        assert head.pooling.widths == {"mean_and_length_test": HIDDEN + 1, "max": HIDDEN}
        assert head.in_features == head.linears[0].in_features == 2 * HIDDEN + 1
        assert MLPHead.parameter_count(model.head_configs["s"]) == (2 * HIDDEN + 1) * 2
        assert model(input_ids=IDS, attention_mask=MASK).preds_by_head["s"].shape == (2, 2)
    finally:
        POOLINGS.remove("mean_and_length_test")


def test_the_backbone_pooler_reaches_only_the_strategy_that_reads_it():
    cfg = HeadConfig("p", num_outputs=2, pred_for_sequence=True, pooling="pooler+mean")
    model = HeadedModel(build_tiny("bert"), [cfg]).eval()
    pooling = model.heads["p"].pooling
    strategies = pooling.strategies
    assert strategies["pooler"].pooler is model.backbone.pooler
    assert not hasattr(strategies["mean"], "pooler")
    assert pooling.pooler is model.backbone.pooler
    assert strategies["pooler"].out_size == model.info.pooler_size
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with torch.no_grad():
        hidden = model.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        direct = model.heads["p"](hidden, mask)  # Head.forward: no pooler to pass
    torch.testing.assert_close(direct, model(input_ids=ids, attention_mask=mask).preds_by_head["p"])
