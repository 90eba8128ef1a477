"""transformer-heads' helpers and call forms, as its notebooks use them (docs/migrating.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_tiny, tiny_config
from transformers import GPT2LMHeadModel

from headkit import (
    ConfigError,
    HeadConfig,
    HeadedCollator,
    HeadedModel,
    evaluate_head_wise,
    get_model_params,
    get_top_n_preds,
    load_headed,
    print_trainable_parameters,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def test_get_model_params_gives_the_class_and_sizes_load_headed_takes(tmp_path: Path):
    build_tiny("gpt2").save_pretrained(tmp_path / "gpt2")
    params = get_model_params(tmp_path / "gpt2")
    assert params["model_class"] is GPT2LMHeadModel
    assert (params["hidden_size"], params["vocab_size"]) == (32, 100)
    assert params["n_layer"] == 3  # the rest of the config, as transformer-heads returns it
    model = load_headed(
        params["model_class"], str(tmp_path / "gpt2"), head_configs=[HeadConfig("p", layer_hook=1)]
    )
    assert isinstance(model, HeadedModel)
    tiny_config("gpt2", num_layers=1, architectures=["NoSuchLM"]).save_pretrained(tmp_path / "odd")
    with pytest.raises(ConfigError, match=r"architectures=\['NoSuchLM'\]"):
        get_model_params(tmp_path / "odd")


def test_print_trainable_parameters_prints_transformer_heads_lines(tiny_gpt2, capsys):
    model = HeadedModel(tiny_gpt2, [HeadConfig("p", num_outputs=3)])
    total = sum(p.numel() for p in model.parameters())
    print_trainable_parameters(model)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"all params: {total} || trainable params: 96 || trainable%: {9600 / total}"
    # transformer-heads prints its defaultdicts as they are (util/model.py)
    assert lines[1] == f"params by dtype: defaultdict(<class 'int'>, {{torch.float32: {total}}})"
    assert lines[2] == "trainable params by dtype: defaultdict(<class 'int'>, {torch.float32: 96})"


def test_get_top_n_preds_reads_token_heads_at_the_end_and_sequence_heads_once(minilm_tokenizer):
    tokenizer = minilm_tokenizer
    heads = [
        HeadConfig("lm_head", is_causal_lm=True),
        HeadConfig("cls", num_outputs=5, pred_for_sequence=True),
    ]
    model = HeadedModel(
        build_tiny("gpt2", num_layers=1, vocab_size=tokenizer.vocab_size), heads
    ).eval()
    top = get_top_n_preds(3, model, "a gorgeous, witty film", tokenizer)
    with torch.no_grad():
        out = model(**tokenizer("a gorgeous, witty film", return_tensors="pt"))
    best = torch.topk(out.preds_by_head["lm_head"][0, -1], 3).indices
    assert top["lm_head"] == [tokenizer.decode(i) for i in best]
    assert top["cls"] == torch.topk(out.preds_by_head["cls"][0], 3).indices.tolist()


def test_evaluate_head_wise_takes_transformer_heads_positional_form(tiny_gpt2):
    model = HeadedModel(tiny_gpt2, [HeadConfig("sent", num_outputs=3, pred_for_sequence=True)])
    data = [{"input_ids": [5 + i, 6, 7], "sent": i % 3} for i in range(6)]
    collator = HeadedCollator(model)
    positional = evaluate_head_wise(model, data, collator, 4, progress=False)
    by_keyword = evaluate_head_wise(model, data, collator=collator, batch_size=4, progress=False)
    assert positional == by_keyword and set(positional["sent"]) == {"loss", "accuracy", "macro_f1"}
