"""What transformers' pipelines and Trainer ask of a model: ``can_generate()`` (true exactly
when a head is a causal-LM head) and ``name_or_path`` (the backbone's)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny
from tiny_text import tiny_tokenizer
from transformers import GPT2Config, GPT2LMHeadModel, pipeline

from headkit import HeadConfig, HeadedModel, load_headed

pytestmark = pytest.mark.usefixtures("single_thread")


def test_can_generate_exactly_with_a_causal_lm_head():
    lm = HeadConfig("lm_head", is_causal_lm=True)
    tags = HeadConfig("tags", num_outputs=2)
    assert HeadedModel(build_tiny("gpt2"), [lm, tags]).can_generate() is True
    assert HeadedModel(build_tiny("gpt2"), [tags]).can_generate() is False
    assert HeadedModel(build_tiny("bert"), [tags]).can_generate() is False


def test_name_or_path_is_the_backbones(tmp_path):
    build_tiny("bert", num_layers=1).save_pretrained(tmp_path)
    model = load_headed(str(tmp_path), head_configs=[HeadConfig("t", num_outputs=2)])
    assert model.name_or_path == str(tmp_path) == model.backbone.name_or_path
    assert HeadedModel(build_tiny("bert"), [HeadConfig("t", num_outputs=2)]).name_or_path == ""


def test_a_text_generation_pipeline_drives_the_model():
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tok),
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=2,
        eos_token_id=len(tok) - 1,  # an id it does not pick here: four tokens are made
        pad_token_id=0,
    )
    base = GPT2LMHeadModel(config).eval()
    model = HeadedModel(base, [HeadConfig("lm_head", is_causal_lm=True)]).eval()
    generate = pipeline("text-generation", model=model, tokenizer=tok)
    out = generate("good w1 w2", max_new_tokens=4, do_sample=False, return_tensors=True)
    ids = tok("good w1 w2", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = base.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert want.shape[1] == ids.shape[1] + 4  # no early eos: four tokens compared
    assert list(out[0]["generated_token_ids"]) == want[0].tolist()
