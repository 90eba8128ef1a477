"""A frozen pretrained ``lm_head`` computes as the backbone's task model does, in its dtype: its
logits and greedy tokens equal ``GPT2LMHeadModel``'s / ``LlamaForCausalLM``'s in float32,
bfloat16 and float16 (the CPU runs half-precision matmuls). Before, an untied Llama's frozen
head held a float32 copy, and its bf16 logits differed from the model's by up to 1e-3.
A trainable head keeps float32 parameters (docs/training.md, "Precision")."""

from __future__ import annotations

import pytest
import torch
from conftest import PAD, build_tiny

from headkit import HeadConfig, HeadedModel

pytestmark = pytest.mark.usefixtures("single_thread")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _prompts() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 100, (3, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return {"input_ids": ids.masked_fill(mask == 0, PAD), "attention_mask": mask}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_frozen_lm_head_gives_the_task_models_logits_and_tokens(arch: str, dtype) -> None:
    hf = build_tiny(arch).to(dtype)
    model = HeadedModel(hf, [HeadConfig("lm_head", is_causal_lm=True, trainable=False)]).eval()
    assert model.heads["lm_head"].output_projection().weight.dtype == dtype
    batch = _prompts()
    positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # headkit's, for HF too
    with torch.no_grad():
        want = hf(**batch, position_ids=positions).logits
        got = model(**batch).preds_by_head["lm_head"]
    real = batch["attention_mask"].bool()
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got[real], want[real])

    settings = {"max_new_tokens": 12, "do_sample": False, "output_logits": True}
    theirs = hf.generate(**batch, **settings, return_dict_in_generate=True)
    ours = model.generate(**batch, **settings)
    assert torch.equal(ours.sequences, theirs.sequences)
    # The prompt's step: transformers' own generate runs the LM head over every prompt
    # position, headkit over the last only; float32 matmuls of other shapes may differ in the
    # last bit (half precision rounds that away). Every later step: the same product.
    torch.testing.assert_close(ours.logits[0], theirs.logits[0])
    for step, (a, b) in enumerate(zip(ours.logits[1:], theirs.logits[1:]), 1):
        assert torch.equal(a, b), f"step {step}"


def test_a_trainable_lm_head_learns_in_float32_on_a_half_precision_backbone() -> None:
    hf = build_tiny("llama").to(torch.bfloat16)
    model = HeadedModel(hf, [HeadConfig("lm_head", is_causal_lm=True)])
    weight = model.heads["lm_head"].output_projection().weight
    assert weight.dtype == torch.float32 and weight.requires_grad
    torch.testing.assert_close(weight, hf.lm_head.weight.float(), rtol=0, atol=0)
    batch = _prompts()
    out = model(**batch, lm_head=batch["input_ids"])
    assert out.preds_by_head["lm_head"].dtype == torch.float32
    out.loss.backward()
    assert weight.grad is not None and weight.grad.dtype == torch.float32
