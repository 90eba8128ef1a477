"""What ``HeadedModel.forward`` returns, and the input stage's one entry (the batch dict)."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import build_tiny

from headkit import BatchError, HeadConfig, HeadedModel, HeadedModelOutput
from headkit.backbone.inputs import STAGE_INPUTS, prepare_inputs

pytestmark = pytest.mark.usefixtures("single_thread")

IDS = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
MASK = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])


def test_return_dict_false_gives_the_tuple_as_transformers_models_do():
    heads = [
        HeadConfig("tag", num_outputs=3),
        HeadConfig("mood", num_outputs=2, pred_for_sequence=True),
    ]
    model = HeadedModel(build_tiny("gpt2"), heads).eval()
    labels = {"tag": IDS % 3, "mood": torch.tensor([0, 1])}
    full = model(input_ids=IDS, attention_mask=MASK, **labels)
    assert isinstance(full, HeadedModelOutput)
    for flag in (None, True):
        assert isinstance(model(input_ids=IDS, return_dict=flag), HeadedModelOutput)
    model.backbone.config.return_dict = False  # the backbone config's flag is not read
    assert isinstance(model(input_ids=IDS), HeadedModelOutput)
    as_tuple = model(input_ids=IDS, attention_mask=MASK, return_dict=False, **labels)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == len(full.to_tuple())
    loss, logits, by_head, adapted, preds = as_tuple  # the fields that are not None, in order
    assert torch.equal(loss, full.loss) and torch.equal(preds["tag"], full.preds_by_head["tag"])
    assert set(logits) == set(by_head) == set(adapted) == {"tag", "mood"}
    no_labels = model(input_ids=IDS, return_dict=False)
    assert isinstance(no_labels[0], dict)  # no loss: the predictions come first


def test_the_input_stage_takes_the_batch_dict_and_names_a_key_it_does_not_know():
    model = HeadedModel(build_tiny("llama"), [HeadConfig("h", loss_fct=None)])
    batch = {"input_ids": IDS, "attention_mask": MASK, "use_cache": False}
    inputs = prepare_inputs(model.backbone, model.info, batch)
    assert inputs.mask is MASK and torch.equal(
        inputs.kwargs["position_ids"][1], torch.tensor([0, 0, 1, 2])
    )
    assert "return_dict" not in STAGE_INPUTS  # it shapes the output, not the backbone's inputs
    with pytest.raises(
        BatchError, match=r"unexpected model input\(s\) \['labels'\]; allowed: \['input_ids'"
    ):
        prepare_inputs(model.backbone, model.info, {**batch, "labels": IDS})


def test_forward_is_the_class_method_and_targets_come_as_labels_or_keywords():
    heads = [
        HeadConfig("tag", num_outputs=3),
        HeadConfig("mood", num_outputs=2, pred_for_sequence=True),
    ]
    model = HeadedModel(build_tiny("gpt2"), heads).eval()
    assert "forward" not in vars(model) and model.forward.__func__ is type(model).forward
    # no signature forged per model: the targets are not parameters, `labels` is
    params = inspect.signature(model.forward).parameters
    assert "labels" in params and not {"tag", "mood"} & set(params)
    tag, mood = IDS % 3, torch.tensor([0, 1])
    by_keyword = model(input_ids=IDS, attention_mask=MASK, tag=tag, mood=mood)
    by_mapping = model(input_ids=IDS, attention_mask=MASK, labels={"tag": tag, "mood": mood})
    mixed = model(input_ids=IDS, attention_mask=MASK, labels={"tag": tag}, mood=mood)
    for out in (by_mapping, mixed):
        assert torch.equal(out.loss, by_keyword.loss)
    with pytest.raises(BatchError, match=r"target\(s\) \['mood'\] given twice"):
        model(input_ids=IDS, labels={"mood": mood}, mood=mood)


def test_a_training_forward_without_any_label_says_once_why_it_has_no_loss(caplog):
    model = HeadedModel(build_tiny("gpt2"), [HeadConfig("mood", num_outputs=2)])
    with caplog.at_level("WARNING", logger="headkit"):
        model.eval()
        assert model(input_ids=IDS).loss is None  # inference: nothing to say
        model.train()
        with torch.no_grad():
            model(input_ids=IDS)
        assert not caplog.records
        for _ in range(2):
            assert model(input_ids=IDS).loss is None
    (record,) = caplog.records
    assert "no label for any head with a loss (targets ['mood'])" in record.getMessage()
    assert "HeadedTrainer" in record.getMessage()
    assert model(input_ids=IDS, mood=IDS % 2).loss is not None
