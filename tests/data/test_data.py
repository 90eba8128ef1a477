"""HeadedCollator: padding of inputs and labels, label dtypes, token-level detection, errors."""

from __future__ import annotations

import pytest
import torch
from conftest import PAD, build_tiny

from headkit import BatchError, ConfigError, HeadConfig, HeadedCollator, HeadedModel

# tiny models gain nothing from more threads, and the machine is shared
pytestmark = pytest.mark.usefixtures("single_thread")


def _model() -> HeadedModel:
    heads = [
        HeadConfig("sent", num_outputs=3, pred_for_sequence=True),
        HeadConfig("ner", num_outputs=5),
        HeadConfig("score", pred_for_sequence=True, is_regression=True, loss_fct="mse"),
        HeadConfig(
            "tags", num_outputs=2, pred_for_sequence=True, loss_fct="bce_with_logits"
        ),  # multi-label: one float per output
    ]
    return HeadedModel(build_tiny("gpt2", num_layers=2), heads)


FEATURES = [
    {"input_ids": [5, 6, 7], "sent": 2, "ner": [1, 2, 3], "score": 0.5, "tags": [1.0, 0.0]},
    {"input_ids": [8], "sent": 0, "ner": [4], "score": -1.25, "tags": [0.0, 1.0]},
]


@pytest.mark.parametrize("side", ["right", "left"])
def test_pads_inputs_and_token_labels_on_the_same_side(side: str) -> None:
    batch = HeadedCollator(_model(), pad_token_id=PAD, padding_side=side)(FEATURES)
    if side == "right":
        ids = [[5, 6, 7], [8, PAD, PAD]]
        mask = [[1, 1, 1], [1, 0, 0]]
        ner = [[1, 2, 3], [4, -100, -100]]
    else:
        ids = [[5, 6, 7], [PAD, PAD, 8]]
        mask = [[1, 1, 1], [0, 0, 1]]
        ner = [[1, 2, 3], [-100, -100, 4]]
    assert batch["input_ids"].tolist() == ids
    assert batch["attention_mask"].tolist() == mask
    labels = batch["labels"]
    assert labels["ner"].tolist() == ner
    assert labels["ner"].dtype == torch.long
    assert labels["sent"].tolist() == [2, 0] and labels["sent"].dtype == torch.long
    assert labels["score"].tolist() == [0.5, -1.25] and labels["score"].dtype == torch.float32
    assert labels["tags"].tolist() == [[1.0, 0.0], [0.0, 1.0]]
    assert batch["input_ids"].dtype == torch.long and batch["attention_mask"].dtype == torch.long


def test_batch_runs_through_the_model_with_the_loss_of_the_unpadded_examples() -> None:
    model = _model().eval()
    feats = [{k: v for k, v in f.items() if k in ("input_ids", "sent", "ner")} for f in FEATURES]
    for side in ("right", "left"):
        batch = HeadedCollator(model, pad_token_id=PAD, padding_side=side)(feats)
        out = model(**batch)  # labels={target: tensor} is unpacked by HeadedModel
        # reference: each example alone (no padding), losses averaged as the heads do
        singles = [model(**HeadedCollator(model, pad_token_id=PAD)([f])) for f in feats]
        sent_ref = sum(o.loss_by_head["sent"] for o in singles) / 2
        ner_ref = (singles[0].loss_by_head["ner"] * 3 + singles[1].loss_by_head["ner"]) / 4
        torch.testing.assert_close(out.loss_by_head["sent"], sent_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.loss_by_head["ner"], ner_ref, atol=1e-5, rtol=1e-5)


def test_pad_id_and_side_come_from_the_tokenizer() -> None:
    from transformers import AutoTokenizer

    from headkit.packaged import minilm_path

    tok = AutoTokenizer.from_pretrained(minilm_path())
    tok.padding_side = "left"
    collator = HeadedCollator(tokenizer=tok)
    assert collator.padding_side == "left" and collator.pad_token_id == tok.pad_token_id == 0
    enc = [tok("a short one"), tok("and a somewhat longer sentence here")]
    batch = collator([{k: v for k, v in e.items()} for e in enc])
    ref = tok.pad(enc, return_tensors="pt")  # the tokenizer's own padding
    assert torch.equal(batch["input_ids"], ref["input_ids"])
    assert torch.equal(batch["attention_mask"], ref["attention_mask"])
    assert torch.equal(batch["token_type_ids"], ref["token_type_ids"])


def test_token_level_is_inferred_from_shape_without_a_model() -> None:
    feats = [
        {"input_ids": [1, 2, 3], "tok": [0, 1, 0], "seq": [0.5, 0.25]},
        {"input_ids": [4, 5], "tok": [1, 1], "seq": [1.0, 2.0]},
    ]
    batch = HeadedCollator(pad_token_id=0)(feats)
    assert batch["labels"]["tok"].tolist() == [[0, 1, 0], [1, 1, -100]]
    assert batch["labels"]["seq"].tolist() == [[0.5, 0.25], [1.0, 2.0]]
    flat = HeadedCollator(pad_token_id=0, labels_key=None, label_pad_value={"tok": 7})(feats)
    assert flat["tok"].tolist() == [[0, 1, 0], [1, 1, 7]] and "labels" not in flat


def test_missing_labels_become_ignored_and_absent_heads_drop_out() -> None:
    model = _model()
    feats = [{"input_ids": [5, 6], "sent": 1, "ner": [1, 2]}, {"input_ids": [7], "sent": None}]
    batch = HeadedCollator(model, pad_token_id=PAD)(feats)
    assert batch["labels"]["ner"].tolist() == [[1, 2], [-100, -100]]
    assert batch["labels"]["sent"].tolist() == [1, -100]
    assert set(batch["labels"]) == {"sent", "ner"}  # "score"/"tags" absent everywhere
    with pytest.raises(BatchError, match=r"'score'.*mse"):  # -100 would be a real mse target
        HeadedCollator(model, pad_token_id=PAD)(
            [{"input_ids": [1], "score": 0.5}, {"input_ids": [2]}]
        )


def test_errors_name_the_field_and_value() -> None:
    model = _model()
    collate = HeadedCollator(model, pad_token_id=PAD)
    with pytest.raises(BatchError, match=r"'ner' of feature 1 has 2 entries.*1 tokens"):
        collate([{"input_ids": [1, 2], "ner": [1, 2]}, {"input_ids": [3], "ner": [1, 2]}])
    with pytest.raises(BatchError, match=r"'text' is neither a model input .* nor a head target"):
        collate([{"input_ids": [1], "text": "hi"}])
    with pytest.raises(BatchError, match=r"no 'input_ids'"):
        collate([{"sent": 1}])
    with pytest.raises(BatchError, match=r"empty list"):
        collate([])
    with pytest.raises(ConfigError, match=r"padding_side='middle'"):
        HeadedCollator(model, padding_side="middle")
    with pytest.raises(BatchError, match=r"attention_mask of length 1 but input_ids of length 2"):
        collate([{"input_ids": [1, 2], "attention_mask": [1]}])


def test_pad_to_multiple_of() -> None:
    batch = HeadedCollator(pad_token_id=0, pad_to_multiple_of=4)([{"input_ids": [1, 2, 3, 4, 5]}])
    assert batch["input_ids"].shape == (1, 8) and batch["attention_mask"].sum() == 5
