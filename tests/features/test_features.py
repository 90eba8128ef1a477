"""Cached features: training heads on them equals training through the frozen backbone."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import VOCAB, build_tiny
from transformers import PreTrainedModel

from headkit import (
    BatchError,
    CachedFeatures,
    ConfigError,
    HeadConfig,
    HeadedModel,
    cache_features,
    train_heads_on_features,
)
from headkit.features import predict_on_features


def _gpt2(num_layers: int = 2) -> PreTrainedModel:
    """A tiny GPT2Model (no LM head) with two attention heads and bos == eos == 0."""
    return build_tiny(
        "gpt2",
        num_layers,
        task="base",
        num_attention_heads=2,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
    )


def _bert() -> PreTrainedModel:
    """A tiny 2-block BertModel with two attention heads."""
    return build_tiny("bert", num_layers=2, num_attention_heads=2)


def make_rows(n: int = 20, seed: int = 1) -> list[dict]:
    """Examples of 2..11 tokens with a class, a score and per-token tags."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(2, 12, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g)
        rows.append(
            {
                "input_ids": ids.tolist(),
                "label": int(ids.sum()) % 3,
                "score": float(ids.float().mean()) / VOCAB,
                "tags": (ids % 5).tolist(),
            }
        )
    return rows


def collate(rows: list[dict], side: str = "right", lm: bool = False) -> dict:
    """Pad to the longest row; token labels (tags, LM labels) are -100 at padding."""
    width = max(len(r["input_ids"]) for r in rows)
    ids, mask, tags = [], [], []
    for r in rows:
        pad = width - len(r["input_ids"])

        def place(seq, fill, pad=pad):
            return [fill] * pad + seq if side == "left" else seq + [fill] * pad

        ids.append(place(r["input_ids"], 0))
        mask.append(place([1] * len(r["input_ids"]), 0))
        tags.append(place(r.get("tags", []), -100))
    batch = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
    if "label" in rows[0]:
        batch["label"] = torch.tensor([r["label"] for r in rows])
    if "score" in rows[0]:
        batch["score"] = torch.tensor([r["score"] for r in rows])
    if "tags" in rows[0]:
        batch["tags"] = torch.tensor(tags)
    if lm:
        batch["lm_labels"] = torch.where(batch["attention_mask"].bool(), batch["input_ids"], -100)
    return batch


def train_through_backbone(
    model: HeadedModel, rows, collate_fn, epochs: int, batch_size: int, seed: int, lr: float
) -> list[float]:
    """The reference: HeadedModel.forward with the batch order train_heads_on_features uses."""
    model.backbone.eval()
    model.heads.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    epoch_losses = []
    for _ in range(epochs):
        order = torch.randperm(len(rows), generator=g).tolist()
        losses = []
        for s in range(0, len(rows), batch_size):
            out = model(**collate_fn([rows[i] for i in order[s : s + batch_size]]))
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            losses.append(float(out.loss.detach()))
        epoch_losses.append(sum(losses) / len(losses))
    return epoch_losses


def assert_same_heads(a: HeadedModel, b: HeadedModel, atol: float = 1e-5) -> None:
    sa, sb = a.head_state_dict(), b.head_state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=atol, rtol=0, msg=k)


def check_equivalence(model: HeadedModel, rows, collate_fn, epochs=2, batch_size=8, lr=0.05):
    reference = copy.deepcopy(model)
    start = copy.deepcopy(model.head_state_dict())
    expected = train_through_backbone(reference, rows, collate_fn, epochs, batch_size, 3, lr)

    feats = cache_features(model, rows, batch_size=7, collate_fn=collate_fn, progress=False)
    got = train_heads_on_features(
        model, feats, epochs=epochs, batch_size=batch_size, lr=lr, seed=3, progress=False
    )
    assert got == pytest.approx(expected, abs=1e-5)
    assert_same_heads(model, reference)
    # the heads really moved, so the comparison is not trivially true
    moved = max((model.head_state_dict()[k] - v).abs().max() for k, v in start.items())
    assert moved > 1e-3
    return feats


def test_sequence_heads_match_training_through_the_backbone():
    # GPT-2, left padding; one MLP head with dropout (same draws as the reference), one
    # regression head on an inner layer with concatenated poolings.
    heads = [
        HeadConfig(
            "sentiment",
            target="label",
            pred_for_sequence=True,
            num_outputs=3,
            num_layers=2,
            hidden_size=16,
            dropout=0.2,
        ),
        HeadConfig(
            "score",
            layer_hook=1,
            pred_for_sequence=True,
            pooling="mean+max",
            is_regression=True,
            loss_fct="mse",
        ),
    ]
    model = HeadedModel(_gpt2(), heads)
    rows = [{k: r[k] for k in ("input_ids", "label", "score")} for r in make_rows()]
    feats = check_equivalence(model, rows, lambda rs: collate(rs, side="left"))
    assert feats.heads["sentiment"]["layout"] == "pooled"
    assert feats.features("score").shape == (20, 64)  # mean+max of width 32
    assert "offsets" not in feats.arrays  # nothing per-token is stored


def test_token_and_attention_pooled_heads_match_training_through_the_backbone():
    # BERT, right padding; a token head with dropout and an attention-pooled sequence head
    # (trainable pooling, so token states are cached) on the same layer share one array.
    heads = [
        HeadConfig("tags", layer_hook=1, num_outputs=5, dropout=0.1),
        HeadConfig(
            "label", layer_hook=1, pred_for_sequence=True, num_outputs=3, pooling="attention"
        ),
    ]
    model = HeadedModel(_bert(), heads)
    rows = [{k: r[k] for k in ("input_ids", "label", "tags")} for r in make_rows()]
    feats = check_equivalence(model, rows, collate)
    n_tokens = sum(len(r["input_ids"]) for r in rows)
    assert feats.num_tokens == n_tokens
    assert feats.heads["label"]["layout"] == "tokens"
    assert feats.heads["tags"]["features"] == feats.heads["label"]["features"]
    assert feats.labels["tags"].shape == (n_tokens,)  # real positions only
    # predictions from the cache equal HeadedModel.forward's in eval mode
    model.eval()
    batch = collate(rows)
    with torch.no_grad():
        preds = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    cached = predict_on_features(model, feats)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(cached["tags"], preds.preds_by_head["tags"][real], atol=1e-5, rtol=0)
    torch.testing.assert_close(cached["label"], preds.preds_by_head["label"], atol=1e-5, rtol=0)


def test_causal_lm_head_matches_training_through_the_backbone():
    # ignore_pads=False (the LM default): padding does not count because its labels are -100.
    heads = [HeadConfig("lm", is_causal_lm=True, target="lm_labels", num_layers=1)]
    model = HeadedModel(_gpt2(), heads)
    rows = [{"input_ids": r["input_ids"]} for r in make_rows()]
    check_equivalence(model, rows, lambda rs: collate(rs, lm=True), epochs=1)


def test_disk_storage_gives_the_same_features_as_memory(tmp_path):
    heads = [
        HeadConfig("tags", layer_hook=1, num_outputs=5),
        HeadConfig("label", pred_for_sequence=True, num_outputs=3, pooling="mean"),
    ]
    model = HeadedModel(_bert(), heads)
    rows = [{k: r[k] for k in ("input_ids", "label", "tags")} for r in make_rows()]
    kw = {"batch_size": 6, "collate_fn": collate, "progress": False}
    mem = cache_features(model, rows, **kw)
    disk = cache_features(model, rows, storage=tmp_path / "cache", **kw)
    reopened = CachedFeatures.load(tmp_path / "cache")
    assert disk.path == tmp_path / "cache" and mem.path is None
    for other in (disk, reopened):
        assert other.arrays.keys() == mem.arrays.keys()
        for k in mem.arrays:
            assert torch.equal(other.arrays[k], mem.arrays[k]), k
        assert other.meta == mem.meta
    # half-precision storage round-trips too (bfloat16 has no numpy dtype)
    half = cache_features(model, rows, storage=tmp_path / "bf16", dtype=torch.bfloat16, **kw)
    for key in mem.meta["feature_keys"]:
        x = CachedFeatures.load(tmp_path / "bf16").arrays[f"features/{key}"]
        assert x.dtype == torch.bfloat16
        assert torch.equal(x, half.arrays[f"features/{key}"])
        assert torch.equal(x, mem.arrays[f"features/{key}"].to(torch.bfloat16))
    # training from disk equals training from memory
    twin = copy.deepcopy(model)
    a = train_heads_on_features(model, mem, epochs=1, batch_size=8, seed=5)
    b = train_heads_on_features(twin, reopened, epochs=1, batch_size=8, seed=5)
    assert a == b
    assert_same_heads(model, twin, atol=0)
    # an existing cache is only replaced on request
    with pytest.raises(ConfigError, match="overwrite=True"):
        cache_features(model, rows, storage=tmp_path / "cache", **kw)
    cache_features(model, rows[:4], storage=tmp_path / "cache", overwrite=True, **kw)
    assert len(CachedFeatures.load(tmp_path / "cache")) == 4


def test_trainable_backbone_is_refused():
    heads = [HeadConfig("label", pred_for_sequence=True, num_outputs=3)]
    rows = [{k: r[k] for k in ("input_ids", "label")} for r in make_rows(4)]
    model = HeadedModel(_bert(), heads, freeze_base_model=False)
    with pytest.raises(ConfigError, match="outside the heads require grad.*stale"):
        cache_features(model, rows, collate_fn=collate, progress=False)
    # caching while frozen, then unfreezing a layer before training, is refused as well
    model.backbone.requires_grad_(False)
    feats = cache_features(model, rows, collate_fn=collate, progress=False)
    model.backbone.encoder.layer[0].requires_grad_(True)
    with pytest.raises(ConfigError, match=r"encoder\.layer\.0"):
        train_heads_on_features(model, feats)


def test_padding_that_counts_in_the_loss_is_refused():
    # ignore_pads=False with real labels at padding: the loss reads padded positions, which
    # a cache of real tokens cannot reproduce.
    heads = [HeadConfig("tags", num_outputs=5, ignore_pads=False)]
    model = HeadedModel(_bert(), heads)
    rows = [{k: r[k] for k in ("input_ids", "tags")} for r in make_rows(6)]

    def zero_pad(rs):
        b = collate(rs)
        b["tags"] = b["tags"].clamp(min=0)
        return b

    with pytest.raises(BatchError, match="padding positions count in its loss"):
        cache_features(model, rows, batch_size=6, collate_fn=zero_pad, progress=False)
    cache_features(model, rows, batch_size=6, collate_fn=collate, progress=False)  # -100: fine


def test_progress_bar_and_early_exit(capsys):
    backbone = _gpt2(num_layers=3)
    model = HeadedModel(backbone, [HeadConfig("label", layer_hook=1, pred_for_sequence=True)])
    calls = []
    handle = backbone.h[1].register_forward_hook(lambda *a: calls.append(1))
    rows = [{"input_ids": r["input_ids"], "label": 0} for r in make_rows(4)]
    try:
        cache_features(model, rows, batch_size=2, collate_fn=collate, progress=False)
        assert capsys.readouterr().err == ""
        cache_features(model, rows, batch_size=2, collate_fn=collate, progress=True)
        assert "caching features" in capsys.readouterr().err
    finally:
        handle.remove()
    assert calls == []  # blocks after the hooked layer never ran


def test_cache_must_match_the_model():
    rows = [{k: r[k] for k in ("input_ids", "label")} for r in make_rows(4)]
    model = HeadedModel(
        _bert(),
        [HeadConfig("label", pred_for_sequence=True, num_outputs=3)],
    )
    feats = cache_features(model, rows, collate_fn=collate, progress=False)
    other = HeadedModel(
        _bert(),
        [HeadConfig("label", pred_for_sequence=True, num_outputs=3, pooling="mean")],
    )
    with pytest.raises(ConfigError, match="pooling='first'.*pooling='mean'"):
        train_heads_on_features(other, feats)
    with pytest.raises(BatchError, match="unexpected batch key"):
        cache_features(
            model, rows, collate_fn=lambda rs: {**collate(rs), "text": ["x"]}, progress=False
        )


def test_default_collator_pads_examples_as_forward_expects():
    # no collate_fn: HeadedCollator(model) pads the examples (labels nested under "labels")
    heads = [
        HeadConfig("tags", layer_hook=1, num_outputs=5),
        HeadConfig("label", pred_for_sequence=True, num_outputs=3),
    ]
    model = HeadedModel(_bert(), heads)
    rows = [{k: r[k] for k in ("input_ids", "label", "tags")} for r in make_rows(9)]
    got = cache_features(model, rows, batch_size=4, progress=False)
    want = cache_features(model, rows, batch_size=4, collate_fn=collate, progress=False)
    assert got.arrays.keys() == want.arrays.keys()
    for k in want.arrays:
        torch.testing.assert_close(got.arrays[k], want.arrays[k], atol=1e-6, rtol=0, msg=k)
