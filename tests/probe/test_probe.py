"""Layer sweeps: layer specs, token alignment, batched probes, planted signals, control tasks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import blocks_of
from tiny_text import planted_texts, tagged_sentences, tiny_tokenizer

from headkit import ConfigError, HeadConfig, HeadedModel, ProbeResults, parse_layers, probe_layers
from headkit.data.encoding import align_labels, encode_words, first_subtokens
from headkit.probe.fit import _fit_softmax, bootstrap_interval, fit_and_score, standardise
from headkit.probe.sweep import parse_poolings


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models gain nothing from more threads on a shared machine."""


# ---------------------------------------------------------------------- specs
@pytest.mark.parametrize(
    "spec, expected",
    [
        ("all", [0, 1, 2, 3, 4, 5, 6]),
        ("0,3,6", [0, 3, 6]),
        ("-4:", [3, 4, 5, 6]),
        ("1:5", [1, 2, 3, 4]),
        ("::2", [0, 2, 4, 6]),
        ("0, -1", [0, 6]),
        ("0,-2:", [0, 5, 6]),
        (-1, [6]),
        ([0, -1, 0], [0, 6]),
    ],
)
def test_parse_layers_indexes_hidden_states(spec, expected) -> None:
    assert parse_layers(spec, num_layers=6) == expected


@pytest.mark.parametrize("spec", ["0,7", "-8", "a", "1:2:3:4", "", "5:1", True, 2.5])
def test_parse_layers_errors_name_the_value_and_the_range(spec) -> None:
    with pytest.raises(ConfigError) as e:
        parse_layers(spec, num_layers=6)
    assert f"layers={spec!r}" in str(e.value)
    assert "-7..6" in str(e.value)


def test_parse_poolings() -> None:
    assert parse_poolings("mean, last,cls") == ["mean", "last", "first"]
    assert parse_poolings(["mean+max", "mean"]) == ["mean+max", "mean"]
    with pytest.raises(ConfigError, match="'bogus' is not a pooling; allowed: .*mean"):
        parse_poolings("mean,bogus")
    with pytest.raises(ConfigError, match="'attention' has trainable parameters"):
        parse_poolings("attention")


# ---------------------------------------------------------------------- token alignment
def test_first_subtoken_gets_the_word_label_others_minus_100() -> None:
    tok = tiny_tokenizer()
    examples, word_index = encode_words(tok, [["good", "unhappy", "w3"]])
    tokens = tok.convert_ids_to_tokens(examples[0]["input_ids"])
    assert tokens == ["[CLS]", "good", "un", "##happy", "w3", "[SEP]"]
    assert word_index[0] == [-1, 0, 1, -1, 2, -1]
    assert align_labels(word_index[0], ["A", "B", "C"]) == [-100, "A", "B", -100, "C", -100]
    # a word repeated right after itself is still two words
    assert first_subtokens([None, 0, 0, 1, 1, None]) == [-1, 0, -1, 1, -1, -1]


# ---------------------------------------------------------------------- batched probes
def _problems(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 120, 6, generator=g)
    w = torch.randn(3, 6, 3, generator=g)
    y = torch.einsum("bnd,bdc->bnc", x, w).argmax(-1)  # (3, 120): one labelling per problem
    return x, y


def test_probes_trained_together_equal_probes_trained_alone() -> None:
    x, y = _problems()
    x_train, x_test = standardise(x[:, :90], x[:, 90:])
    labels = y[0]  # the same labels for every problem here
    fit = torch.ones(2, 90, dtype=torch.bool)
    fit[0, :20] = False
    fit[1, 70:] = False
    l2 = torch.tensor([1e-3, 1e-1])
    args = (fit, l2, 3, 500, 1e-7)
    together = fit_and_score(x_train, labels[None, :90], x_test, labels[None, 90:], *args)
    for b in range(3):
        alone = fit_and_score(
            x_train[b : b + 1], labels[None, :90], x_test[b : b + 1], labels[None, 90:], *args
        )
        torch.testing.assert_close(alone.test, together.test[b : b + 1])
        torch.testing.assert_close(alone.val, together.val[b : b + 1])
        torch.testing.assert_close(alone.l2, together.l2[b : b + 1])


def test_softmax_probe_matches_sklearn_logistic_regression() -> None:
    from sklearn.linear_model import LogisticRegression

    x, y = _problems(1)
    x_train, x_test = standardise(x[:1, :90], x[:1, 90:])
    fit = torch.ones(1, 90, dtype=torch.bool)
    fit[0, 80:] = False  # the last 10 rows validate
    l2 = 0.01
    got = fit_and_score(
        x_train, y[:1, :90], x_test, y[:1, 90:], fit, torch.tensor([l2]), 3, 2000, 1e-8
    )
    # mean CE + l2 |W|^2  ==  C * sum CE + |W|^2 / 2  with  C = 1 / (2 l2 n)
    ref = LogisticRegression(C=1 / (2 * l2 * 80), tol=1e-10, max_iter=10_000)
    ref.fit(x_train[0, :80].numpy(), y[0, :80].numpy())
    acc = ref.score(x_test[0].numpy(), y[0, 90:].numpy())
    assert float(got.test[0, 0, 0]) == pytest.approx(acc, abs=1e-6)
    assert float(got.train[0, 0, 0]) == pytest.approx(
        ref.score(x_train[0, :80].numpy(), y[0, :80].numpy()), abs=1e-6
    )


def test_binary_probe_matches_sklearn_logistic_regression() -> None:
    """Two classes are fitted as one logistic regression: the same optimum as 2-class softmax."""
    from sklearn.linear_model import LogisticRegression

    x, y = _problems(2)
    y = (y > 0).long()
    x_train, x_test = standardise(x[:1, :90], x[:1, 90:])
    fit = torch.ones(1, 90, dtype=torch.bool)
    fit[0, 80:] = False
    l2 = 0.003
    got = fit_and_score(
        x_train, y[:1, :90], x_test, y[:1, 90:], fit, torch.tensor([l2]), 2, 2000, 1e-8
    )
    # 2-class softmax with l2 |W|^2 == logistic with (l2 / 2) |u|^2 == sklearn C = 1 / (l2 n)
    ref = LogisticRegression(C=1 / (l2 * 80), tol=1e-10, max_iter=10_000)
    ref.fit(x_train[0, :80].numpy(), y[0, :80].numpy())
    assert float(got.test[0, 0, 0]) == pytest.approx(
        ref.score(x_test[0].numpy(), y[0, 90:].numpy()), abs=1e-6
    )
    rows = fit.float() / fit.sum()
    w, b = _fit_softmax(x_train, y[:1, :90], rows, torch.tensor([l2]), 2, 2000, 1e-8, None)
    u = (w[..., 1] - w[..., 0]).reshape(-1)  # the logit difference: sklearn's coef_
    np.testing.assert_allclose(u.numpy(), ref.coef_[0], atol=2e-4)
    np.testing.assert_allclose(float(b[..., 1] - b[..., 0]), ref.intercept_[0], atol=2e-4)


def test_ridge_probe_matches_sklearn_and_r2_is_two_pass() -> None:
    from sklearn.linear_model import Ridge
    from sklearn.metrics import r2_score

    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 100, 5, generator=g)
    y = 1e4 + x[0] @ torch.tensor([1.0, -2.0, 0.5, 0.0, 0.0]) + 0.3 * torch.randn(100, generator=g)
    x_train, x_test = standardise(x[:, :80], x[:, 80:])
    fit = torch.ones(1, 80, dtype=torch.bool)
    fit[0, 60:] = False
    got = fit_and_score(
        x_train, y[None, :80], x_test, y[None, 80:], fit, torch.tensor([0.05]), None
    )
    ref = Ridge(alpha=0.05 * 60).fit(x_train[0, :60].numpy(), y[:60].numpy())
    expected = r2_score(y[80:].numpy(), ref.predict(x_test[0].numpy()))
    assert float(got.test[0, 0, 0]) == pytest.approx(expected, abs=1e-4)  # large offset: stable


def test_bootstrap_interval_brackets_the_score() -> None:
    items = (torch.rand(2, 3, 1, 200, generator=torch.Generator().manual_seed(0)) < 0.7).float()
    ci = bootstrap_interval(items, torch.zeros(1, 200), False, 500, seed=0)
    score = items.mean(1).mean(-1)  # (2, 1)
    assert bool((ci[..., 0] < score).all()) and bool((score < ci[..., 1]).all())
    assert bool((ci[..., 1] - ci[..., 0] < 0.15).all())


# ---------------------------------------------------------------------- sweeps
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tiny_text import save_tiny_text_model

    return save_tiny_text_model(tmp_path_factory.mktemp("tiny_bert"), num_layers=2)


def test_sweep_finds_a_planted_signal_and_the_control_task_does_not(tiny_dir) -> None:
    texts, labels, _ = planted_texts(400)
    res = probe_layers(tiny_dir, texts, labels, control=True, val_splits=2, progress=False)
    assert res.metric == "accuracy" and res.layers == [0, 1, 2]
    majority = max(np.mean(labels), 1 - np.mean(labels))
    assert abs(res.baseline - majority) < 0.12
    assert max(r.score for r in res.rows) >= 0.9  # "good" is in the text: linearly decodable
    for r in res.rows:
        assert r.selectivity == pytest.approx(r.score - r.control)
        assert r.control < r.score
        assert r.control < res.baseline + 0.15  # random labels per text: nothing to generalise
        assert r.ci95[0] <= r.score <= r.ci95[1]
        assert r.std is not None and len(r.l2) == 2
    assert res.n_train + res.n_test == 400 and len(res.test_index) == 80


def test_results_json_table_and_plot(tiny_dir, tmp_path) -> None:
    texts, labels, _ = planted_texts(80)
    res = probe_layers(
        tiny_dir,
        texts,
        labels,
        layers="0,-1",
        pooling="mean,first",
        control=True,
        progress=False,
    )
    data = json.loads(res.to_json(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text()) == data
    assert data["metric"] == "accuracy" and data["poolings"] == ["mean", "first"]
    row = data["rows"][0]
    for key in (
        "layer",
        "pooling",
        "accuracy",
        "train_accuracy",
        "val_accuracy",
        "std",
        "ci95",
        "baseline",
        "l2",
        "control_accuracy",
        "control_train_accuracy",
        "selectivity",
    ):
        assert key in row
    assert row["std"] is not None  # 5 folds by default: the spread of their probes
    assert [(r["pooling"], r["layer"]) for r in data["rows"]] == [
        ("mean", 0),
        ("mean", 2),
        ("first", 0),
        ("first", 2),
    ]
    table = res.table()
    assert "selectivity" in table and "baseline" in table and "best on validation" in table
    png = res.plot(tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert isinstance(res, ProbeResults) and res.best() in res.rows


def test_regression_sweep_reports_r2(tiny_dir) -> None:
    texts, _, scores = planted_texts(240, seed=3)
    res = probe_layers(tiny_dir, texts, scores, task="regression", layers=[0], progress=False)
    row = res.to_dict()["rows"][0]
    assert "r2" in row and "train_r2" in row and "accuracy" not in row
    assert row["r2"] > 0.5
    assert -0.1 < res.baseline <= 0.0  # the training mean predicts the held-out mean


def test_token_sweep_labels_first_subtokens_only(tiny_dir) -> None:
    words, tags = tagged_sentences(120)
    res = probe_layers(tiny_dir, words, tags, task="token", control=True, progress=False)
    assert res.classes == ["CUE", "NEG", "W"]
    assert res.n_train + res.n_test == sum(len(w) for w in words)  # one row per word
    # the tags of "not" and "unhappy" (two sub-tokens: tagged by "un") come from word identity
    assert res.row(0, "token").score > res.baseline + 0.1
    for r in res.rows:
        assert r.selectivity == pytest.approx(r.score - r.control)
        assert r.control_train > 0.9  # a label per word type: learnable from the embeddings


def test_sweep_runs_blocks_only_up_to_the_deepest_layer(tiny_dir, make_tiny) -> None:
    model = make_tiny("bert", num_layers=4)
    calls = [0] * 4
    hooks = [
        b.register_forward_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, b in enumerate(blocks_of(model))
    ]
    texts, labels, _ = planted_texts(40)
    try:
        probe_layers(
            model,
            texts,
            labels,
            tokenizer=tiny_tokenizer(),
            layers="0,1",
            batch_size=8,
            progress=False,
        )
    finally:
        for h in hooks:
            h.remove()
    assert calls[0] == 5  # 40 texts / 8 per batch: block 0 makes layer 1
    assert calls[1:] == [0, 0, 0]


def test_backbone_left_as_it_was(make_tiny) -> None:
    model = make_tiny("bert", num_layers=2).train()
    model.encoder.layer[0].requires_grad_(False)
    before = [p.requires_grad for p in model.parameters()]
    texts, labels, _ = planted_texts(40)
    probe_layers(model, texts, labels, tokenizer=tiny_tokenizer(), progress=False)
    assert [p.requires_grad for p in model.parameters()] == before
    assert model.training


def test_headed_model_and_argument_errors(make_tiny) -> None:
    model = make_tiny("bert", num_layers=2)
    headed = HeadedModel(model, [HeadConfig("x", pred_for_sequence=True)])
    texts, labels, _ = planted_texts(40)
    res = probe_layers(headed, texts, labels, tokenizer=tiny_tokenizer(), progress=False)
    assert res.num_layers == 2
    with pytest.raises(ConfigError, match="tokenizer=None"):
        probe_layers(model, texts, labels, progress=False)
    tok = tiny_tokenizer()
    cases = [
        (dict(task="tagging"), "task='tagging' is invalid; allowed: classification"),
        (dict(val_splits=0), "val_splits=0 is invalid"),
        (dict(layers="0,9"), "layers='0,9': 9 is out of range; allowed: 'all', indices -3..2"),
        (dict(pooling="attention"), "trainable parameters"),
        (dict(task="token", pooling="mean"), "does not apply to task='token'"),
        (dict(test_fraction=1.5), "test_fraction=1.5 is invalid"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            probe_layers(model, texts, labels, tokenizer=tok, progress=False, **kwargs)
    with pytest.raises(ConfigError, match="got 40 inputs but 39 labels"):
        probe_layers(model, texts, labels[:-1], tokenizer=tok, progress=False)
    with pytest.raises(ConfigError, match="single class"):
        probe_layers(model, texts, [1] * 40, tokenizer=tok, progress=False)


def test_real_minilm_sweep(minilm) -> None:
    """The packaged MiniLM separates obviously positive from obviously negative snippets."""
    model, tok = minilm
    good = [
        "a wonderful, moving film",
        "brilliant and funny",
        "I loved every minute",
        "a delightful surprise",
        "superb acting and a great story",
        "charming and warm",
    ]
    bad = [
        "a dull, lifeless mess",
        "boring and far too long",
        "I hated every minute",
        "an awful waste of time",
        "terrible acting and a stupid story",
        "tedious and flat",
    ]
    texts = [f"{t} ({i})" for i in range(4) for t in good + bad]
    labels = [1] * 6 + [0] * 6
    labels = labels * 4
    res = probe_layers(model, texts, labels, tokenizer=tok, layers="-2:", progress=False)
    assert res.layers == [5, 6]
    assert max(r.score for r in res.rows) > res.baseline
