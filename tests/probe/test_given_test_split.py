"""A probe scored on a given test split (an official test set) instead of a held-out fraction."""

from __future__ import annotations

import pytest
from tiny_text import planted_texts, save_tiny_text_model

from headkit import ConfigError, probe_layers


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models gain nothing from more threads on a shared machine."""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_text_model(tmp_path_factory.mktemp("tiny_bert"), num_layers=2)


def test_scores_on_the_given_split_and_trains_on_all_inputs(tiny_dir) -> None:
    texts, labels, _ = planted_texts(300)
    test_texts, test_labels, _ = planted_texts(60, seed=7)
    res = probe_layers(
        tiny_dir, texts, labels, test_inputs=test_texts, test_labels=test_labels, progress=False
    )
    assert res.n_test == 60 and res.n_train == 300
    assert res.test_index == list(range(60))  # positions in test_inputs
    assert max(r.score for r in res.rows) >= 0.9
    assert "test_fraction" not in res.settings and res.settings["n_test_examples"] == 60
    # the same test texts with every label flipped: the score is measured on them, not elsewhere
    flipped = [1 - y for y in test_labels]
    res_flipped = probe_layers(
        tiny_dir, texts, labels, test_inputs=test_texts, test_labels=flipped, progress=False
    )
    for a, b in zip(res.rows, res_flipped.rows):
        assert a.score + b.score == pytest.approx(1.0)
        assert a.val_score == pytest.approx(b.val_score)  # validation still from the inputs


def test_texts_is_the_older_name_of_inputs(tiny_dir) -> None:
    texts, labels, _ = planted_texts(60)
    a = probe_layers(tiny_dir, texts, labels, layers="-1", progress=False)
    b = probe_layers(tiny_dir, texts=texts, labels=labels, layers="-1", progress=False)
    assert a.rows[0].score == b.rows[0].score
    with pytest.raises(ConfigError, match="not both"):
        probe_layers(tiny_dir, texts, labels, texts=texts, progress=False)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"test_inputs": ["w1 good"]}, "test_inputs was given without test_labels"),
        ({"test_labels": [1]}, "test_labels was given without test_inputs"),
        ({"test_inputs": ["w1", "w2"], "test_labels": [1]}, "2 test_inputs but 1 test_labels"),
        ({"test_inputs": [], "test_labels": []}, "test_inputs is empty"),
    ],
)
def test_a_malformed_test_split_is_refused(tiny_dir, kwargs, pattern) -> None:
    texts, labels, _ = planted_texts(40)
    with pytest.raises(ConfigError, match=pattern):
        probe_layers(tiny_dir, texts, labels, progress=False, **kwargs)
