"""``probe_layers(keep_features=True)`` + ``features_given``: a head trains on the sweep's
features exactly as on ``cache_features``' (issue 33: the demo's one backbone pass)."""

from __future__ import annotations

import torch
from tiny_text import planted_texts, save_tiny_text_model

from headkit import HeadConfig, HeadedModel
from headkit.features import cache_features, features_given
from headkit.probe.sweep import probe_layers


def test_a_sweeps_features_are_the_cache_a_head_would_build(tmp_path):
    from transformers import AutoModel, AutoTokenizer

    folder = save_tiny_text_model(tmp_path / "tiny", num_layers=2)
    texts, labels, _ = planted_texts(40, seed=1)
    results = probe_layers(
        str(folder), texts, labels, val_splits=1, bootstrap=10, progress=False, keep_features=True
    )
    assert results.features[("mean", 1)].shape[0] == len(texts)
    tok = AutoTokenizer.from_pretrained(str(folder))
    cfg = HeadConfig("y", layer_hook=1, pred_for_sequence=True, pooling="mean", num_outputs=2)
    model = HeadedModel(AutoModel.from_pretrained(str(folder)), [cfg], freeze_base_model=True)
    data = [{**tok(t, truncation=True, max_length=128), "y": int(y)} for t, y in zip(texts, labels)]
    cached = cache_features(model, data, batch_size=8, progress=False)
    given = features_given(model, data, {"y": results.features[("mean", 1)]})
    assert torch.allclose(given.features("y"), cached.features("y"), atol=1e-5)
    assert torch.equal(given.labels["y"], cached.labels["y"])


def test_heads_sharing_a_layer_and_pooling_share_one_given_array(tmp_path):
    from transformers import AutoModel, AutoTokenizer

    folder = save_tiny_text_model(tmp_path / "tiny", num_layers=2)
    texts, labels, _ = planted_texts(12, seed=2)
    tok = AutoTokenizer.from_pretrained(str(folder))
    cfgs = [
        HeadConfig(n, layer_hook=1, pred_for_sequence=True, pooling="mean", target="y")
        for n in ("a", "b")
    ]
    model = HeadedModel(AutoModel.from_pretrained(str(folder)), cfgs, freeze_base_model=True)
    data = [
        {**tok(t, truncation=True, max_length=128), "y": float(y)} for t, y in zip(texts, labels)
    ]
    cached = cache_features(model, data, batch_size=4, progress=False)
    pooled = cached.features("a")
    given = features_given(model, data, {"a": pooled, "b": pooled})
    assert given.features("a").shape == given.features("b").shape == pooled.shape
    assert torch.equal(given.features("b"), pooled)
