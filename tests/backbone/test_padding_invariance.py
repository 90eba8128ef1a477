"""A row gives the same predictions whatever its padding: right, left, or a gap of padding
between its tokens. Encoders included: position ids come from the mask.

Each padded batch is compared with every row run alone, unpadded, for a token head and a
sequence head pooling every way, on GPT-2, Llama, BERT, RoBERTa and DistilBERT. Backbones
whose forward takes no ``position_ids`` cannot be helped: a gap is refused, and left padding
gets a warning (once) when the model has an absolute position table.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import build_tiny
from transformers import BertModel

from headkit import BatchError, HeadConfig, HeadedModel
from headkit.backbone.inputs import prepare_inputs

pytestmark = pytest.mark.usefixtures("single_thread")

ROWS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14]]
FILLER = 4  # the id at padded positions: deliberately not the pad id of any model here
ARCHS = ("gpt2", "llama", "bert", "roberta", "distilbert")
HEADS = [
    HeadConfig("tok", num_outputs=3),
    HeadConfig("mid", num_outputs=3, layer_hook=1),
    HeadConfig(
        "seq",
        num_outputs=4,
        pred_for_sequence=True,
        pooling="mean+max+first+last+weighted_mean+mean_sqrt_len",
    ),
]


def padded(rows: list[list[int]], layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and mask of ``rows`` padded with FILLER: "right", "left", or "gap" (two padded
    positions after each row's first token, then right padding)."""
    shaped = []
    for r in rows:
        ids, mask = list(r), [1] * len(r)
        if layout == "gap" and len(r) > 1:
            ids = ids[:1] + [FILLER, FILLER] + ids[1:]
            mask = mask[:1] + [0, 0] + mask[1:]
        shaped.append((ids, mask))
    width = max(len(ids) for ids, _ in shaped) + 1  # every row gets at least one pad
    out_ids, out_mask = [], []
    for ids, mask in shaped:
        fill = width - len(ids)
        if layout == "left":
            ids, mask = [FILLER] * fill + ids, [0] * fill + mask
        else:
            ids, mask = ids + [FILLER] * fill, mask + [0] * fill
        out_ids.append(ids)
        out_mask.append(mask)
    return torch.tensor(out_ids), torch.tensor(out_mask)


@pytest.fixture(scope="module", params=ARCHS)
def headed(request) -> HeadedModel:
    return HeadedModel(build_tiny(request.param, num_layers=2), HEADS).eval()


@pytest.mark.parametrize("layout", ["right", "left", "gap"])
def test_a_row_predicts_the_same_whatever_its_padding(headed: HeadedModel, layout: str):
    ids, mask = padded(ROWS, layout)
    with torch.no_grad():
        batch = headed(input_ids=ids, attention_mask=mask).preds_by_head
        for i, row in enumerate(ROWS):
            alone = headed(input_ids=torch.tensor([row])).preds_by_head
            real = mask[i].bool()
            torch.testing.assert_close(batch["seq"][i], alone["seq"][0], atol=1e-5, rtol=1e-5)
            for name in ("tok", "mid"):
                torch.testing.assert_close(
                    batch[name][i][real], alone[name][0], atol=1e-5, rtol=1e-5
                )


@pytest.mark.parametrize("arch", ["bert", "distilbert", "roberta"])
def test_right_padding_keeps_the_encoders_own_positions(arch: str):
    """Right-padded batches get exactly the positions the model would use by default, padded
    positions included (RoBERTa: its own numbering from padding_idx)."""
    backbone = build_tiny(arch, num_layers=2)
    model = HeadedModel(backbone, HEADS)
    ids, mask = padded(ROWS, "right")
    if arch == "roberta":
        pad = backbone.config.pad_token_id
        ids = ids.masked_fill(mask == 0, pad)
        want = backbone.embeddings.create_position_ids_from_input_ids(ids, pad)
    else:
        want = torch.arange(ids.shape[1]).expand_as(ids)
    got = prepare_inputs(model.backbone, model.info, {"input_ids": ids, "attention_mask": mask})
    assert torch.equal(got.kwargs["position_ids"], want)
    with torch.no_grad():
        theirs = backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        ours = backbone(**got.kwargs).last_hidden_state
    assert torch.equal(ours, theirs)


# ---------------------------------------------------------------------- no position_ids
class BertWithoutPositionIds(BertModel):
    """A real BERT whose forward does not take ``position_ids`` (as some architectures)."""

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, **kwargs):
        return super().forward(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        )


def test_without_position_ids_a_gap_is_refused_saying_why():
    for backbone in (
        build_tiny("bloom", num_layers=2).eval(),
        BertWithoutPositionIds(build_tiny("bert").config).eval(),
    ):
        model = HeadedModel(backbone, HEADS)
        ids, mask = padded(ROWS, "gap")
        with pytest.raises(BatchError) as info:
            model(input_ids=ids, attention_mask=mask)
        message = str(info.value)
        assert "row 0 ([1, 0, 0, 1, 1, 1, 1, 1, 0]) has padding between real tokens" in message
        assert f"{type(backbone).__name__} takes no position_ids" in message


def test_without_position_ids_left_padding_warns_once_for_absolute_positions():
    model = HeadedModel(BertWithoutPositionIds(build_tiny("bert").config).eval(), HEADS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # right padding: nothing to warn about
        model(input_ids=padded(ROWS, "right")[0], attention_mask=padded(ROWS, "right")[1])
    ids, mask = padded(ROWS, "left")
    with pytest.warns(UserWarning, match=r"BertWithoutPositionIds takes no position_ids"):
        model(input_ids=ids, attention_mask=mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model
        model(input_ids=ids, attention_mask=mask)


def test_without_position_ids_or_table_left_padding_is_exact_and_silent():
    """Bloom (ALiBi) has no absolute positions: left padding changes nothing, no warning."""
    model = HeadedModel(build_tiny("bloom", num_layers=2).eval(), HEADS)
    ids, mask = padded(ROWS, "left")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        batch = model(input_ids=ids, attention_mask=mask).preds_by_head
        alone = model(input_ids=torch.tensor([ROWS[0]])).preds_by_head
    torch.testing.assert_close(batch["seq"][0], alone["seq"][0], atol=1e-5, rtol=1e-5)
