"""The weak spots of the transformer-heads compatibility: the batches evaluate_head_wise
evaluates are the collator's, only_inference / fully_trained_heads change what trains, its
positional and keyword call forms, 0-dim labels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from th_fixtures import GPT2_BASE, LLAMA_BASE, LORA
from transformers import GPT2LMHeadModel, LlamaForCausalLM

from headkit import HeadConfig, HeadedCollator, compat, evaluate_head_wise, load_headed
from headkit.compat import create_headed_qlora, load_lora_with_heads

pytestmark = pytest.mark.usefixtures("single_thread")
HEADS = [
    HeadConfig("sent", num_outputs=2, pred_for_sequence=True),
    HeadConfig("tag", num_outputs=3),
]
FEATURES = [
    {"input_ids": [5 + i, 6, 7, 8][: 2 + i % 3], "sent": i % 2, "tag": [i % 3] * (2 + i % 3)}
    for i in range(6)
]


def _seen(model) -> list[dict]:
    seen: list[dict] = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(dict(kw)), with_kwargs=True)
    return seen


def _same(batch: dict, seen: dict) -> None:
    for key, value in batch.items():
        if isinstance(value, dict):
            _same(value, seen[key])
        else:
            assert torch.equal(seen[key], value), key


class FixedLength:
    """A collator of its own: pads to 6 on the left, labels at the top level."""

    def __call__(self, features: list[dict]) -> dict:
        ids = torch.full((len(features), 6), 2)
        mask = torch.zeros_like(ids)
        tags = torch.full_like(ids, -100)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, 6 - n :], mask[i, 6 - n :] = torch.tensor(f["input_ids"]), 1
            tags[i, 6 - n :] = torch.tensor(f["tag"])
        sent = torch.tensor([f["sent"] for f in features])
        return {"input_ids": ids, "attention_mask": mask, "sent": sent, "tag": tags}


@pytest.mark.parametrize("collator", [None, FixedLength()], ids=["default", "its own"])
def test_evaluate_head_wise_evaluates_the_collators_batches(collator):
    model = load_headed(str(GPT2_BASE), head_configs=HEADS)
    expected = collator or HeadedCollator(model)
    seen = _seen(model)
    ours = evaluate_head_wise(model, FEATURES, collator, batch_size=4, progress=False)
    assert len(seen) == 2
    for got, features in zip(seen, (FEATURES[:4], FEATURES[4:])):
        _same(expected(features), got)
    seen.clear()
    loss, by_head = compat.evaluate_head_wise(model, FEATURES, collator, batch_size=4, epochs=0.5)
    assert len(seen) == 1  # epochs=0.5 of 2 batches
    _same(expected(FEATURES[:4]), seen[0])
    with torch.no_grad():
        out = model(**expected(FEATURES[:4]))
    assert by_head == pytest.approx({k: float(v) for k, v in out.loss_by_head.items()})
    assert loss == pytest.approx(float(out.loss)) and set(ours) == {"sent", "tag"}


def _trainable(model) -> set[str]:
    return {
        n.split(".")[0] + ("/lora" if "lora_" in n else "")
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def test_only_inference_and_fully_trained_heads_change_what_trains(tmp_path: Path):
    assert _trainable(load_headed(LlamaForCausalLM, str(LLAMA_BASE), HEADS)) == {"heads"}
    frozen = load_headed(LlamaForCausalLM, str(LLAMA_BASE), HEADS, None, True)  # its order
    assert _trainable(frozen) == set() and not frozen.training
    assert _trainable(load_lora_with_heads(LORA)) == {"backbone/lora", "heads"}
    assert _trainable(load_lora_with_heads(LORA, fully_trained_heads=False)) == {"backbone/lora"}
    assert _trainable(load_lora_with_heads(LORA, only_inference=True)) == set()
    model = create_headed_qlora(LlamaForCausalLM, str(LLAMA_BASE), None, None, HEADS, False)
    assert _trainable(model) == {"backbone/lora"}  # fully_trained_heads=False, positionally


def test_its_keyword_and_positional_call_forms():
    by_keywords = load_headed(
        base_model_class=GPT2LMHeadModel,
        model_name=str(GPT2_BASE),
        head_configs=HEADS,
        device_map="auto",
        adaptive_loss=True,
        torch_dtype=torch.float32,
    )
    assert by_keywords.loss_weighting.name == "adaptive" and by_keywords.dtype == torch.float32
    # its order: head_configs, head_folder_path, only_inference, device_map, ...
    th = load_headed(GPT2LMHeadModel, str(GPT2_BASE), HEADS, None, False, "cpu", None, False)
    assert _trainable(th) == {"heads", "backbone"}  # freeze_base_model=False
    # headkit's order: model_name, head_configs, head_folder_path, freeze_base_model, ...
    hk = load_headed(str(GPT2_BASE), None, HEADS, None, False, True)
    assert _trainable(hk) == set()
    with pytest.raises(TypeError, match="multiple values for argument 'head_configs'"):
        load_headed(GPT2LMHeadModel, str(GPT2_BASE), HEADS, head_configs=HEADS)
    with pytest.raises(TypeError, match="missing the model"):
        load_headed(head_configs=HEADS)
    qlora = create_headed_qlora(
        base_model_class=LlamaForCausalLM,
        model_name=str(LLAMA_BASE),
        quantization_config=None,
        lora_config=None,
        head_configs=HEADS,
        fully_trained_heads=True,
        device_map="cpu",
        gradient_checkpointing=False,
        adaptive_loss=True,
        torch_dtype=torch.float32,
    )
    assert qlora.loss_weighting.name == "adaptive"
    assert _trainable(load_lora_with_heads(base_model_class=LlamaForCausalLM, path=LORA)) == {
        "backbone/lora",
        "heads",
    }


def test_0_dim_labels_for_one_example_as_it_accepts_them():
    model = load_headed(str(GPT2_BASE), head_configs=HEADS)
    ids = torch.tensor([[5, 6, 7]])
    one = model(input_ids=ids, sent=torch.tensor(1)).loss_by_head["sent"]
    assert torch.equal(one, model(input_ids=ids, sent=torch.tensor([1])).loss_by_head["sent"])
    with pytest.raises(ValueError, match="do not match the batch size 2"):
        model(input_ids=ids.repeat(2, 1), sent=torch.tensor(1))
    with pytest.raises(ValueError, match="labels of shape"):
        model(input_ids=ids, tag=torch.tensor(1))  # a token head needs one per position


def test_compat_helpers_as_it_has_them():
    a = load_headed(str(GPT2_BASE), head_configs=HEADS)
    b = load_headed(str(GPT2_BASE), head_configs=HEADS)
    lines = compat.compare_all_params(a, b)
    assert lines and all(line.startswith("values not even close heads.") for line in lines)
    assert compat.compare_all_params(a, a) == []
    cls = compat.get_multi_head_transformer(GPT2LMHeadModel)
    assert cls is compat.get_multi_head_transformer(GPT2LMHeadModel) and issubclass(
        cls, compat.HeadedModel
    )
    with pytest.raises(ValueError, match="PreTrainedModel class"):
        compat.get_multi_head_transformer(int)
    assert a.model is a.backbone
    batch = compat.DataCollatorWithPadding({"input_ids": 2, "tag": -100})(FEATURES[:2])
    assert batch["input_ids"].tolist() == [[5, 6], [6, 6, 7][:3]][:1] + [[6, 6, 7]] or batch[
        "input_ids"
    ].shape == (2, 3)
    assert batch["tag"].tolist() == [[0, 0, -100], [1, 1, 1]] and batch["sent"].tolist() == [0, 1]
    assert compat.HeadedModelGenerateOutput(token_logprobs=torch.ones(1)).logprobs.tolist() == [1.0]


def test_compare_all_params_pairs_parameters_by_transformer_heads_names():
    """headkit names the backbone ``backbone.*`` and heads ``heads.<h>.mlp.<k>``; its
    ``compare_all_params`` reads them as transformer-heads named them, so a HeadedModel against
    the ``*ForCausalLM`` it came from reports only what the model adds."""
    lm = HeadConfig("lm_head", is_causal_lm=True, num_layers=1)
    model = load_headed(GPT2LMHeadModel, str(GPT2_BASE), head_configs=[lm, *HEADS])
    hf = GPT2LMHeadModel.from_pretrained(str(GPT2_BASE))
    assert compat.compare_all_params(model, hf) == [
        "name mismatch heads.sent.lins.0.weight (not in model2)",
        "name mismatch heads.tag.lins.0.weight (not in model2)",
        f"parameter count mismatch {len(compat.th_parameter_names(hf)) + 2} "
        f"{len(compat.th_parameter_names(hf))}",
    ]
    names = compat.th_parameter_names(model)
    assert "transformer.h.0.attn.c_attn.weight" in names and "lm_head.weight" in names
    with torch.no_grad():
        hf.transformer.h[0].attn.c_attn.weight[0, 0] += 1
    assert compat.compare_all_params(model, hf)[0].startswith(
        "values not even close transformer.h.0.attn.c_attn.weight"
    )
