"""What ``HeadedModel.forward`` returns, and the input stage's one entry (the batch dict)."""

from __future__ import annotations

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
