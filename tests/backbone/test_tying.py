"""An ``lm_head`` head of a model that ties its LM head to the input embeddings (tiny GPT-2):
frozen, it shares that matrix (no copy, memory as the bare model) and checkpoints record the tie
instead of writing the matrix; trainable, it is a real copy, trained and saved on its own."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import PAD, build_tiny
from safetensors.torch import load_file

from headkit import CheckpointError, HeadConfig, HeadedModel, load_headed
from headkit.checkpoint import MANIFEST

pytestmark = pytest.mark.usefixtures("single_thread")

LM_KEY = "heads.lm_head.mlp.0.weight"
IDS = torch.tensor([[PAD, PAD, 5, 6, 7], [8, 9, 10, 11, 12]])
MASK = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])


def heads(trainable: bool) -> list[HeadConfig]:
    return [
        HeadConfig("lm_head", is_causal_lm=True, trainable=trainable),
        HeadConfig("value", num_outputs=1, is_regression=True, loss_fct="mse"),
    ]


def numel(module: torch.nn.Module) -> int:
    """Parameters counted once each, however many modules share them."""
    return sum(p.numel() for p in module.parameters())


def test_a_frozen_lm_head_shares_the_tied_embeddings():
    hf = build_tiny("gpt2")
    assert hf.config.tie_word_embeddings and hf.lm_head.weight is hf.transformer.wte.weight
    model = HeadedModel(hf, heads(trainable=False)).eval()
    lm = model.heads["lm_head"].linears[0].weight
    assert lm is model.backbone.wte.weight
    assert lm.data_ptr() == model.backbone.wte.weight.data_ptr()
    # memory: the bare model plus the value head (32 weights), no vocab × hidden copy
    assert numel(model) == numel(model.backbone) + 32
    assert LM_KEY not in model.head_state_dict()
    out = model(input_ids=IDS, attention_mask=MASK)
    ref = hf(input_ids=IDS, attention_mask=MASK, position_ids=(MASK.cumsum(-1) - 1).clamp(min=0))
    torch.testing.assert_close(out.preds_by_head["lm_head"], ref.logits, atol=0, rtol=0)


def test_a_frozen_tied_lm_head_generates_bit_identical_scores():
    hf = build_tiny("gpt2")
    model = HeadedModel(hf, heads(trainable=False)).eval()
    expected = hf.generate(
        IDS, attention_mask=MASK, max_new_tokens=6, output_scores=True, return_dict_in_generate=True
    )
    out = model.generate(IDS, attention_mask=MASK, max_new_tokens=6, output_scores=True)
    assert torch.equal(out.sequences, expected.sequences)
    for ours, theirs in zip(out.scores, expected.scores):
        assert torch.equal(ours, theirs)


def test_a_trainable_lm_head_is_an_untied_copy_that_trains_alone():
    hf = build_tiny("gpt2")
    model = HeadedModel(hf, heads(trainable=True))
    lm, wte = model.heads["lm_head"].linears[0].weight, model.backbone.wte.weight
    assert lm is not wte and lm.data_ptr() != wte.data_ptr() and torch.equal(lm, wte)
    before = wte.detach().clone()
    out = model(input_ids=IDS, attention_mask=MASK, lm_head=IDS)
    out.loss.backward()
    with torch.no_grad():
        lm -= 0.5 * lm.grad
    assert torch.equal(wte, before) and not torch.equal(lm, before)
    assert LM_KEY in model.head_state_dict()


def test_an_untied_model_keeps_a_copy_even_when_frozen():
    hf = build_tiny("llama")
    assert not hf.config.tie_word_embeddings
    model = HeadedModel(hf, heads(trainable=False))
    lm = model.heads["lm_head"].linears[0].weight
    assert lm is not model.backbone.embed_tokens.weight and torch.equal(lm, hf.lm_head.weight)
    assert LM_KEY in model.head_state_dict()


def test_a_lm_head_on_a_trainable_backbone_is_a_copy():
    model = HeadedModel(build_tiny("gpt2"), heads(trainable=False), freeze_base_model=False)
    assert model.heads["lm_head"].linears[0].weight is not model.backbone.wte.weight


def _saved(tmp_path, model: HeadedModel) -> tuple[dict, dict]:
    model.save_pretrained(tmp_path)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    return manifest, load_file(tmp_path / manifest["weights"])


def test_a_checkpoint_records_the_tie_and_never_writes_the_matrix(tmp_path):
    hf = build_tiny("gpt2")
    hf.save_pretrained(tmp_path / "gpt2")
    model = load_headed(tmp_path / "gpt2", head_configs=heads(trainable=False))
    assert model.heads["lm_head"].linears[0].weight is model.backbone.wte.weight
    manifest, state = _saved(tmp_path / "ckpt", model)
    assert manifest["tied_to_input_embeddings"] == [LM_KEY]
    assert manifest["backbone"]["kind"] == "reference"
    assert LM_KEY not in state and sum(t.numel() for t in state.values()) == 32
    for again in (  # both restore routes tie it again to the loaded backbone's embeddings
        HeadedModel.from_pretrained(tmp_path / "ckpt"),
        load_headed(tmp_path / "gpt2", head_folder_path=tmp_path / "ckpt"),
    ):
        lm = again.heads["lm_head"].linears[0].weight
        assert lm is again.backbone.wte.weight
        assert numel(again) == numel(again.backbone) + 32
        torch.testing.assert_close(
            again(input_ids=IDS, attention_mask=MASK).preds_by_head["lm_head"],
            model(input_ids=IDS, attention_mask=MASK).preds_by_head["lm_head"],
            atol=0,
            rtol=0,
        )
        gen = again.generate(IDS, attention_mask=MASK, max_new_tokens=5)
        assert torch.equal(gen.sequences, hf.generate(IDS, attention_mask=MASK, max_new_tokens=5))


def test_a_fine_tuned_backbone_is_saved_and_the_head_retied_to_it(tmp_path):
    model = HeadedModel(build_tiny("gpt2"), heads(trainable=False))  # built in memory: saved
    with torch.no_grad():
        model.backbone.wte.weight.mul_(2.0)  # the tied lm_head follows the embeddings
    manifest, state = _saved(tmp_path, model)
    assert manifest["backbone"]["kind"] == "saved" and LM_KEY not in state
    again = HeadedModel.from_pretrained(tmp_path)
    assert again.heads["lm_head"].linears[0].weight is again.backbone.wte.weight
    torch.testing.assert_close(again.backbone.wte.weight, model.backbone.wte.weight)


def test_a_trainable_lm_head_is_saved_and_restored_as_a_copy(tmp_path):
    model = HeadedModel(build_tiny("gpt2"), heads(trainable=True))
    with torch.no_grad():
        model.heads["lm_head"].linears[0].weight.add_(1.0)  # trained away from the embeddings
    manifest, state = _saved(tmp_path, model)
    assert "tied_to_input_embeddings" not in manifest and LM_KEY in state
    again = HeadedModel.from_pretrained(tmp_path)
    lm = again.heads["lm_head"].linears[0].weight
    assert lm is not again.backbone.wte.weight
    torch.testing.assert_close(lm, model.heads["lm_head"].linears[0].weight, atol=0, rtol=0)


def test_a_checkpoint_with_a_stored_copy_loads_into_a_tied_model(tmp_path):
    """A checkpoint that stores the matrix (trainable head, or written before ties) wins: the
    model that tied its frozen head gets the stored values as its own copy."""
    hf = build_tiny("gpt2")
    hf.save_pretrained(tmp_path / "gpt2")
    trained = load_headed(tmp_path / "gpt2", head_configs=heads(trainable=True))
    with torch.no_grad():
        trained.heads["lm_head"].linears[0].weight.mul_(0.5)
    trained.save_pretrained(tmp_path / "ckpt")
    frozen = load_headed(
        tmp_path / "gpt2", head_configs=heads(trainable=False), head_folder_path=tmp_path / "ckpt"
    )
    lm = frozen.heads["lm_head"].linears[0].weight
    assert lm is not frozen.backbone.wte.weight and not lm.requires_grad
    torch.testing.assert_close(lm, trained.heads["lm_head"].linears[0].weight, atol=0, rtol=0)


TIE_ERRORS = {
    "tied-field-not-a-list": (
        "heads.lm_head.mlp.0.weight",
        r"tied_to_input_embeddings='heads.lm_head.mlp.0.weight' is invalid; a list of head "
        r"parameter names",
    ),
    "tied-name-not-a-head-parameter": (
        ["heads.lm_head.mlp.7.weight"],
        r"tied weight 'heads.lm_head.mlp.7.weight' names no parameter of the heads",
    ),
    "tied-weight-of-another-shape": (
        ["heads.value.mlp.0.weight"],
        r"'heads.value.mlp.0.weight' is tied to the input embeddings, but the backbone's are "
        r"\(100, 32\) and the head expects \(1, 32\)",
    ),
}


@pytest.mark.parametrize("tied,pattern", TIE_ERRORS.values(), ids=TIE_ERRORS)
def test_tie_checkpoint_error(tmp_path, tied, pattern):
    _saved(tmp_path, HeadedModel(build_tiny("gpt2"), heads(trainable=False)))
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    manifest["tied_to_input_embeddings"] = tied
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=pattern):
        HeadedModel.from_pretrained(tmp_path)
