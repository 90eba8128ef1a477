"""The number of validation splits is ``val_splits`` (beside ``seed``, which draws them): in
``probe_layers``, ``ProbeResults``, its JSON and its table."""

from __future__ import annotations

import json

import pytest
from tiny_text import planted_texts, save_tiny_text_model

from headkit import ConfigError, probe_layers

pytestmark = pytest.mark.usefixtures("single_thread")


def test_val_splits_is_named_so_everywhere(tmp_path):
    folder = save_tiny_text_model(tmp_path / "tiny", num_layers=1)
    texts, labels, _ = planted_texts(60)
    res = probe_layers(folder, texts, labels, layers="-1", val_splits=3, seed=4, progress=False)
    assert res.val_splits == 3 and res.settings["seed"] == 4
    row = res.rows[0]
    assert row.std is not None and len(row.l2) == 3  # one L2 chosen per validation split
    data = json.loads(res.to_json())
    assert data["val_splits"] == 3 and "seeds" not in data
    assert "mean over 3 validation splits (val_splits)" in res.table()
    one = probe_layers(folder, texts, labels, layers="-1", val_splits=1, progress=False)
    assert one.val_splits == 1 and one.rows[0].std is None
    assert "mean over 1 validation split (val_splits)" in one.table()
    default = probe_layers(folder, texts, labels, layers="-1", progress=False)
    assert default.val_splits == 5 and default.settings["folds"] == 5  # 5-fold by default
    assert "mean over 5 folds (folds)" in default.table()
    with pytest.raises(ConfigError, match=r"val_splits=0 is invalid; an integer >= 1"):
        probe_layers(folder, texts, labels, val_splits=0, progress=False)
    with pytest.raises(ConfigError, match=r"folds=1 is invalid; an integer >= 2"):
        probe_layers(folder, texts, labels, folds=1, progress=False)
    with pytest.raises(ConfigError, match=r"val_splits=3 and folds=4 were both given"):
        probe_layers(folder, texts, labels, val_splits=3, folds=4, progress=False)
    with pytest.raises(TypeError, match=r"seeds"):
        probe_layers(folder, texts, labels, seeds=2, progress=False)
