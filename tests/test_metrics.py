"""Per-head metrics against hand-computed values (sklearn is not installed: numpy by hand)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import PAD, build_tiny
from torch.utils.data import DataLoader

from headkit import HeadConfig, HeadedCollator, HeadedModel, HeadwiseMetrics, evaluate_head_wise
from headkit.metrics import compute_head_metrics

# tiny models gain nothing from more threads, and the machine is shared
pytestmark = pytest.mark.usefixtures("single_thread")


def _cfg(**kw) -> HeadConfig:
    return HeadConfig(**{"name": "h", **kw})


def _one_hot_logits(pred_ids: list, n: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(pred_ids), n).float() * 5.0


def test_accuracy_and_macro_f1_by_hand() -> None:
    cfg = _cfg(num_outputs=4, pred_for_sequence=True)
    labels = [0, 1, 2, 2, -100, 1]
    preds = [0, 2, 2, 1, 3, 1]  # the -100 example predicts class 3: it must not count
    m = compute_head_metrics(cfg, _one_hot_logits(preds, 4), torch.tensor(labels))
    # valid pairs (label, pred): (0,0) (1,2) (2,2) (2,1) (1,1) → 3 of 5 right
    # F1: class 0: tp1 fp0 fn0 → 1; class 1: tp1 fp1 fn1 → 0.5; class 2: tp1 fp1 fn1 → 0.5;
    # class 3 never occurs in labels or (counted) predictions → left out, as sklearn does
    assert m["accuracy"] == pytest.approx(3 / 5)
    assert m["macro_f1"] == pytest.approx((1 + 0.5 + 0.5) / 3)


def test_token_classification_ignores_padding_from_mask_and_minus_100() -> None:
    cfg = _cfg(num_outputs=3)  # token head, ignore_pads defaults to True
    preds = _one_hot_logits([[0, 1, 2], [2, 2, 0]], 3)
    labels = torch.tensor([[0, 1, 1], [2, -100, 1]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # (1, 2) is padding: its wrong pred is ignored
    m = compute_head_metrics(cfg, preds, labels, mask)
    # counted: (0,0) (1,1) (1,2) (2,2) → accuracy 3/4
    # F1: c0 1; c1 tp1 fn1 → 2/3; c2 tp1 fp1 → 2/3
    assert m["accuracy"] == pytest.approx(3 / 4)
    assert m["macro_f1"] == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)


def test_regression_mse_mae_r2_by_numpy() -> None:
    cfg = _cfg(num_outputs=2, pred_for_sequence=True, is_regression=True, loss_fct="mse")
    rng = np.random.default_rng(0)
    y = rng.normal(size=(7, 2))
    p = y + rng.normal(scale=0.3, size=(7, 2))
    y_masked = y.copy()
    y_masked[3, 1] = -100.0  # ignored in column 1
    m = compute_head_metrics(cfg, torch.tensor(p), torch.tensor(y_masked))
    per = []
    for j in range(2):
        keep = y_masked[:, j] != -100
        yy, pp = y[keep, j], p[keep, j]
        mse = np.mean((pp - yy) ** 2)
        mae = np.mean(np.abs(pp - yy))
        r2 = 1 - np.sum((pp - yy) ** 2) / np.sum((yy - yy.mean()) ** 2)
        per.append((mse, mae, r2))
    ref = np.mean(per, axis=0)  # uniform average over outputs
    assert m["mse"] == pytest.approx(ref[0], rel=1e-9)
    assert m["mae"] == pytest.approx(ref[1], rel=1e-9)
    assert m["r2"] == pytest.approx(ref[2], rel=1e-9)
    # one-output head with (batch,) labels; perfect predictions give r2 = 1
    one = _cfg(pred_for_sequence=True, is_regression=True, loss_fct="mse")
    perfect = compute_head_metrics(one, torch.tensor([[1.0], [2.0]]), torch.tensor([1.0, 2.0]))
    assert perfect == {"mse": 0.0, "mae": 0.0, "r2": 1.0}


def test_binary_head_thresholds_logits() -> None:
    cfg = _cfg(num_outputs=2, pred_for_sequence=True, loss_fct="bce_with_logits")
    logits = torch.tensor([[2.0, -1.0], [-0.5, 0.5], [1.0, 1.0]])  # predicted [[1,0],[0,1],[1,1]]
    labels = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, -100.0]])
    m = compute_head_metrics(cfg, logits, labels)
    # column 0: (1,1) (0,1) (1,0) → tp1 fn1 fp1 → F1 0.5; column 1: (0,0) (1,1) → tp1 → F1 1
    assert m["accuracy"] == pytest.approx(3 / 5)
    assert m["macro_f1"] == pytest.approx(0.75)


def test_perplexity_equals_exp_of_the_heads_own_loss() -> None:
    model = HeadedModel(
        build_tiny("gpt2", num_layers=2), [HeadConfig("lm_head", is_causal_lm=True)]
    ).eval()
    feats = [{"input_ids": [5, 9, 11, 3, 7], "lm_head": [5, 9, 11, 3, 7]},
             {"input_ids": [4, 8], "lm_head": [4, 8]}]  # fmt: skip
    batch = HeadedCollator(model, pad_token_id=PAD)(feats)
    with torch.no_grad():
        out = model(**batch)
    # one head with a loss: batch["labels"] is its tensor, as transformers' collators make it
    m = compute_head_metrics(
        model.head_configs["lm_head"], out.preds_by_head["lm_head"], batch["labels"]
    )
    assert m["perplexity"] == pytest.approx(math.exp(float(out.loss_by_head["lm_head"])), rel=1e-5)
    # and by hand: the 4 + 1 shifted next-token predictions
    logp = torch.log_softmax(out.preds_by_head["lm_head"].double(), -1)
    nll = [-logp[0, t, feats[0]["input_ids"][t + 1]] for t in range(4)]
    nll.append(-logp[1, 0, feats[1]["input_ids"][1]])
    assert m["perplexity"] == pytest.approx(math.exp(float(sum(nll)) / 5), rel=1e-9)


def _model_and_data():
    model = HeadedModel(
        build_tiny("bert", num_layers=2),
        [
            HeadConfig("sent", num_outputs=3, pred_for_sequence=True),
            HeadConfig("ner", num_outputs=4),
            HeadConfig("score", pred_for_sequence=True, is_regression=True, loss_fct="mse"),
        ],
    )
    g = torch.Generator().manual_seed(3)
    data = []
    for i in range(10):
        n = 2 + i % 4
        ids = torch.randint(1, 100, (n,), generator=g).tolist()
        data.append(
            {
                "input_ids": ids,
                "sent": i % 3,
                "ner": [(i + j) % 4 for j in range(n)],
                "score": i / 4,
            }  # fmt: skip
        )
    return model, data


def test_evaluate_head_wise_matches_whole_data_metrics() -> None:
    model, data = _model_and_data()
    res = evaluate_head_wise(model, data, batch_size=3, progress=False)
    assert set(res) == {"sent", "ner", "score"}
    # reference: every example alone, predictions stitched together
    model.eval()
    collate = HeadedCollator(model)
    sent_p, ner_p, ner_y, score_p = [], [], [], []
    with torch.no_grad():
        for f in data:
            out = model(**collate([f]))
            sent_p.append(out.preds_by_head["sent"])
            ner_p.append(out.preds_by_head["ner"][0])
            ner_y.append(torch.tensor(f["ner"]))
            score_p.append(out.preds_by_head["score"])
    cfgs = model.head_configs
    sent_ref = compute_head_metrics(
        cfgs["sent"], torch.cat(sent_p), torch.tensor([f["sent"] for f in data])
    )
    ner_ref = compute_head_metrics(
        cfgs["ner"], torch.cat(ner_p)[None], torch.cat(ner_y)[None]
    )  # all tokens as one long row
    score_ref = compute_head_metrics(
        cfgs["score"], torch.cat(score_p), torch.tensor([f["score"] for f in data])
    )
    for name, ref in (("sent", sent_ref), ("ner", ner_ref), ("score", score_ref)):
        for k, v in ref.items():
            assert res[name][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (name, k)
    # the loss entry: per-batch losses weighted by batch size; a DataLoader is used as given
    loader = DataLoader(data, batch_size=10, collate_fn=collate)
    whole = evaluate_head_wise(model, loader, progress=False)
    with torch.no_grad():
        out = model(**collate(data))
    assert whole["sent"]["loss"] == pytest.approx(float(out.loss_by_head["sent"]), rel=1e-6)
    assert whole["score"]["mse"] == pytest.approx(float(out.loss_by_head["score"]), rel=1e-5)


def test_headwise_metrics_reads_trainer_outputs() -> None:
    model, data = _model_and_data()
    batch = HeadedCollator(model)(data)
    with torch.no_grad():
        out = model.eval()(**batch)
    preds = {k: v.numpy() for k, v in out.preds_by_head.items()}
    labels = {k: v.numpy() for k, v in batch["labels"].items()}
    metrics = HeadwiseMetrics(model)
    flat = metrics(SimpleNamespace(predictions=preds, label_ids=labels))
    ref = compute_head_metrics(model.head_configs["ner"], preds["ner"], labels["ner"])
    assert flat["ner_accuracy"] == pytest.approx(ref["accuracy"])
    assert {"sent_accuracy", "sent_macro_f1", "score_mse", "score_mae", "score_r2"} <= set(flat)
    # the vanilla Trainer's tuple (loss dicts first, preds_by_head last) reads the same
    vanilla = ({k: np.float32(1.0) for k in preds}, {}, preds)
    assert metrics(SimpleNamespace(predictions=vanilla, label_ids=labels)) == flat
    # batch_eval_metrics=True: batches accumulate until compute_result=True
    halves = [slice(0, 6), slice(6, None)]
    parts = [
        SimpleNamespace(
            predictions={k: v[h] for k, v in preds.items()},
            label_ids={k: v[h] for k, v in labels.items()},
        )
        for h in halves
    ]
    assert metrics(parts[0], compute_result=False) == {}
    streamed = metrics(parts[1], compute_result=True)
    assert streamed.keys() == flat.keys()
    for k in flat:
        assert streamed[k] == pytest.approx(flat[k], rel=1e-9), k
