"""A probe you can use: per-example predictions and probabilities, per-class metrics (checked
against scikit-learn), stratified and k-fold splits, and ``to_headed``: the probe as a headkit
head whose predictions on the held-out inputs are the probe's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from sklearn import metrics as skm
from tiny_text import planted_texts, save_tiny_text_model, tagged_sentences

from headkit import HeadedModel, probe_layers
from headkit.backbone.sources import source_tokenizer
from headkit.data.encoding import encode_texts
from headkit.metrics import ranking_report
from headkit.probe.data import prepare_rows, split_rows

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_text_model(tmp_path_factory.mktemp("tiny_bert"), num_layers=2)


def _three_classes(n: int):
    texts, _, scores = planted_texts(n, seed=3)
    return texts, [["none", "one", "many"][min(int(s), 2)] for s in scores]


def test_per_class_metrics_match_sklearn(tiny_dir) -> None:
    texts, labels = _three_classes(300)
    res = probe_layers(tiny_dir, texts, labels, layers="0,-1", progress=False)
    assert res.classes == ["many", "none", "one"]
    y = np.array(res.test_labels)
    assert len(y) == res.n_test == len(res.test_index)
    for row in res.rows:
        hat = np.array(row.predictions)
        probs = np.array(row.probabilities)
        assert probs.shape == (res.n_test, 3) and np.allclose(probs.sum(1), 1)
        assert (probs.argmax(1) == hat).all()
        m = row.metrics
        assert m["accuracy"] == pytest.approx(skm.accuracy_score(y, hat)) == row.score
        assert m["macro_f1"] == pytest.approx(skm.f1_score(y, hat, average="macro"))
        assert m["micro_f1"] == pytest.approx(skm.f1_score(y, hat, average="micro"))
        assert m["weighted_f1"] == pytest.approx(skm.f1_score(y, hat, average="weighted"))
        assert m["macro_precision"] == pytest.approx(
            skm.precision_score(y, hat, average="macro", zero_division=0)
        )
        assert m["macro_recall"] == pytest.approx(skm.recall_score(y, hat, average="macro"))
        p, r, f, support = skm.precision_recall_fscore_support(
            y, hat, labels=[0, 1, 2], zero_division=0
        )
        for i, name in enumerate(res.classes):
            per = m["per_class"][name]
            assert (per["precision"], per["recall"], per["f1"]) == pytest.approx((p[i], r[i], f[i]))
            assert per["support"] == support[i]
        assert m["confusion_matrix"] == skm.confusion_matrix(y, hat, labels=[0, 1, 2]).tolist()
    table = res.table()
    assert "macro F1" in table and "confusion matrix" in table and "many" in table
    data = json.loads(res.to_json())
    assert data["rows"][0]["metrics"]["per_class"]["one"]["support"] == int((y == 2).sum())
    shown = data["test_predictions"]
    assert shown["labels"] == [res.classes[i] for i in res.test_labels]
    assert shown["predictions"] == [res.classes[i] for i in res.best().predictions]


def test_binary_auroc_and_average_precision_match_sklearn(tiny_dir) -> None:
    texts, labels, _ = planted_texts(200)
    res = probe_layers(tiny_dir, texts, labels, layers="-1", progress=False)
    row = res.rows[0]
    y, p1 = np.array(res.test_labels), np.array(row.probabilities)[:, 1]
    assert row.metrics["auroc"] == pytest.approx(skm.roc_auc_score(y, p1))
    assert row.metrics["average_precision"] == pytest.approx(skm.average_precision_score(y, p1))
    assert "AUROC" in res.table()


def test_ranking_report_with_ties_matches_sklearn() -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 500)
    s = np.round(rng.random(500) + 0.3 * y, 1)  # many tied scores
    got = ranking_report(y, s)
    assert got["auroc"] == pytest.approx(skm.roc_auc_score(y, s))
    assert got["average_precision"] == pytest.approx(skm.average_precision_score(y, s))
    assert np.isnan(ranking_report([1, 1], [0.2, 0.3])["auroc"])  # one class: undefined


def test_to_headed_gives_the_probes_predictions(tiny_dir, tmp_path) -> None:
    texts, labels = _three_classes(240)
    res = probe_layers(tiny_dir, texts, labels, layers="all", pooling="mean,first", progress=False)
    for layer, pooling in [(None, None), (1, "first")]:
        row = res.best() if layer is None else res.row(layer, pooling)
        model = res.to_headed(layer=layer, pooling=pooling)
        assert isinstance(model, HeadedModel)
        cfg = model.head_configs["probe"]
        assert (cfg.layer_hook, cfg.pooling) == (row.layer, row.pooling)
        assert cfg.extra["classes"] == res.classes
        probs = _head_probabilities(model, tiny_dir, [texts[i] for i in res.test_index])
        assert probs.argmax(1).tolist() == row.predictions  # exactly the probe's decisions
        expected = torch.tensor(row.probabilities, dtype=torch.float64)
        assert torch.allclose(probs, expected, atol=2e-4)
    # saved and loaded, it predicts the same
    model.save_pretrained(tmp_path / "probe_head")
    again = HeadedModel.from_pretrained(tmp_path / "probe_head")
    reloaded = _head_probabilities(again, tiny_dir, [texts[i] for i in res.test_index])
    assert reloaded.argmax(1).tolist() == row.predictions


def test_to_headed_regression_predicts_in_the_labels_units(tiny_dir) -> None:
    texts, _, scores = planted_texts(200)
    values = [100.0 + 25.0 * s for s in scores]  # far from standardised
    res = probe_layers(tiny_dir, texts, values, task="regression", layers="-1", progress=False)
    row = res.rows[0]
    assert res.test_labels == pytest.approx([values[i] for i in res.test_index])
    y, hat = np.array(res.test_labels), np.array(row.predictions)
    assert row.metrics["r2"] == pytest.approx(skm.r2_score(y, hat), abs=1e-5)
    assert row.metrics["mse"] == pytest.approx(skm.mean_squared_error(y, hat), rel=1e-5)
    model = res.to_headed()
    assert model.head_configs["probe"].is_regression
    tok = source_tokenizer(str(tiny_dir))
    batch = tok([texts[i] for i in res.test_index], padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**batch).preds_by_head["probe"][:, 0]
    assert torch.allclose(out.double(), torch.tensor(hat), atol=1e-3)


def test_to_headed_token_probe(tiny_dir) -> None:
    sents, tags = tagged_sentences(80)
    res = probe_layers(tiny_dir, sents, tags, task="token", layers="-1", progress=False)
    model = res.to_headed()
    cfg = model.head_configs["probe"]
    assert not cfg.pred_for_sequence and cfg.num_outputs == len(res.classes)
    assert len(res.rows[0].predictions) == len(res.test_labels)  # one per held-out word


def _head_probabilities(model: HeadedModel, folder, texts: list[str]) -> torch.Tensor:
    tok = source_tokenizer(str(folder))
    examples = encode_texts(tok, texts, 128)
    batch = tok.pad(examples, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).preds_by_head["probe"]
    return torch.softmax(logits.double(), -1)


# ---------------------------------------------------------------------- splits
def test_splits_are_stratified_and_folds_validate_each_example_once() -> None:
    from tiny_text import tiny_tokenizer

    labels = [0] * 90 + [1] * 10  # 10% minority
    texts = [f"w{i % 7} w{i % 5}" for i in range(100)]
    rows = prepare_rows(tiny_tokenizer(), texts, labels, "classification", 16)
    for seed in range(5):
        split = split_rows(rows, 0.2, 0.2, 1, seed, folds=5)
        held = rows.y[split["test"]]
        assert int((held == 1).sum()) == 2 and len(held) == 20  # the minority's share, exactly
        validated = (~split["fit"]).sum(0)
        assert validated.tolist() == [1] * 80  # every training example validates once
        minority = rows.y[split["train"]] == 1
        for fold in split["fit"]:
            assert int((~fold & minority).sum()) in (1, 2)  # 8 minority over 5 folds
        random_splits = split_rows(rows, 0.2, 0.2, 3, seed)
        for fit in random_splits["fit"]:
            assert int((~fit & minority).sum()) in (1, 2)  # 16 validation rows, ~10% each
