"""Reduced ports of transformer-heads' probe notebooks (gpt2 and llama ``linear_probe`` and
``multi_linear_probe``, gpt2 ``text_classification_linear_probe`` and ``_full_finetune``):
its code as written plus only docs/migrating.md's renames, on the prelude's tiny models and
synthetic data (tests/th_ports.py); CUDA-only cells dropped (4-bit loading: quantization_config
=None, device_map="cpu"). Each port checks what its notebook looks at."""

# ruff: noqa: SIM118  (its notebooks' code as written: `for split in dd.keys()`)
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from th_ports import load_dataset, tiny_hub, training_args
from transformers import AutoTokenizer, Trainer

from headkit.compat import (
    DataCollatorWithPadding,
    HeadConfig,
    evaluate_head_wise,
    get_model_params,
    get_some_preds,
    get_top_n_preds,
    load_headed,
    print_trainable_parameters,
)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture
def hub(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch) -> dict:
    monkeypatch.chdir(tmp_path)  # its output_dir names are relative
    return tiny_hub(tmp_path_factory.getbasetemp() / "hub")


@pytest.mark.parametrize("name", ["gpt2", "meta-llama/Llama-2-7b-hf"])
def test_linear_probe(hub, name, capsys):
    model_path = hub[name]
    train_epochs, eval_epochs, logging_steps = 1, 1, 100
    model_params = get_model_params(model_path)
    model_class = model_params["model_class"]
    hidden_size = model_params["hidden_size"]
    vocab_size = model_params["vocab_size"]
    heads_configs = [
        HeadConfig(
            name="wikitext_head",
            layer_hook=-4,  # Hook to layer [-4] (Drop 3 layers from the end)
            in_size=hidden_size,
            num_layers=1,
            output_activation="linear",
            is_causal_lm=True,
            loss_fct="cross_entropy",
            num_outputs=vocab_size,
            is_regression=False,
            output_bias=False,
        )
    ]
    dd = load_dataset("wikitext", "wikitext-2-v1")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token

    def tokenize_function(examples):
        out = tokenizer(examples["text"], padding=False, truncation=True)
        out[heads_configs[0].name] = out["input_ids"].copy()
        return out

    for split in dd.keys():
        dd[split] = dd[split].filter(function=lambda example: len(example["text"]) > 10)
        dd[split] = dd[split].map(tokenize_function, batched=True)
    dd.set_format(type="torch", columns=["input_ids", "attention_mask", heads_configs[0].name])
    for split in dd.keys():
        dd[split] = dd[split].remove_columns("text")
    quantization_config = None  # CUDA only: BitsAndBytesConfig(load_in_4bit=True, ...)
    model = load_headed(
        model_class,
        model_path,
        head_configs=heads_configs,
        quantization_config=quantization_config,
        device_map="cpu",  # was {"": torch.cuda.current_device()}
    )
    print_trainable_parameters(model)
    assert "trainable params: 3200 ||" in capsys.readouterr().out  # the probe only
    before = get_top_n_preds(n=5, model=model, text="w1 w2 good", tokenizer=tokenizer)
    args = training_args(
        output_dir="linear_probe_test",
        learning_rate=0.0002,
        num_train_epochs=train_epochs,
        logging_steps=logging_steps,
        do_eval=False,
        remove_unused_columns=False,  # Important to set to False, otherwise things will fail
    )
    collator = DataCollatorWithPadding(
        feature_name_to_padding_value={
            "input_ids": tokenizer.pad_token_id,
            heads_configs[0].name: -100,
            "attention_mask": 0,
        }
    )
    trainer = Trainer(model, args=args, train_dataset=dd["train"], data_collator=collator)
    trainer.train()
    loss, by_head = evaluate_head_wise(model, dd["validation"], collator, epochs=eval_epochs)
    assert set(by_head) == {"wikitext_head"} and loss == pytest.approx(by_head["wikitext_head"])
    after = get_top_n_preds(5, model, "w1 w2 good", tokenizer)
    assert len(before["wikitext_head"]) == len(after["wikitext_head"]) == 5


@pytest.mark.parametrize("name", ["gpt2", "meta-llama/Llama-2-7b-hf"])
def test_multi_linear_probe(hub, name):
    model_path = hub[name]
    model_params = get_model_params(model_path)
    model_class = model_params["model_class"]
    hidden_size = model_params["hidden_size"]
    vocab_size = model_params["vocab_size"]
    head_configs = [
        HeadConfig(
            name=f"wikitext_head_{(1 + (i - 1) * 2)}",
            layer_hook=-(1 + (i - 1) * 2),
            in_size=hidden_size,
            hidden_size=0,
            num_layers=1,
            output_activation="linear",
            is_causal_lm=True,
            loss_fct="cross_entropy",
            num_outputs=vocab_size,
            is_regression=False,
            output_bias=False,
        )
        for i in range(1, 8)
    ]
    head_configs.append(
        HeadConfig(
            name="lm_head",
            layer_hook=-1,
            in_size=hidden_size,
            hidden_size=0,
            num_layers=1,
            output_activation="linear",
            is_causal_lm=True,
            loss_fct="cross_entropy",
            num_outputs=vocab_size,
            is_regression=False,
            output_bias=False,
            trainable=False,
        )
    )
    dd = load_dataset("wikitext", "wikitext-2-v1")
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    def tokenize_function(examples):
        out = tokenizer(examples["text"], padding=False, truncation=True)
        for hc in head_configs:
            out[hc.name] = out["input_ids"].copy()
        return out

    for split in dd.keys():
        dd[split] = dd[split].filter(function=lambda example: len(example["text"]) > 10)
        dd[split] = dd[split].map(tokenize_function, batched=True)
    dd.set_format(
        type="torch", columns=["input_ids", "attention_mask"] + [x.name for x in head_configs]
    )
    for split in dd.keys():
        dd[split] = dd[split].remove_columns("text")
    model = load_headed(
        model_class,
        model_path,
        head_configs=head_configs,
        quantization_config=None,
        device_map="cpu",
    )
    lm_before = model.heads["lm_head"].output_projection().weight.detach().clone()
    args = training_args(
        output_dir="linear_probe_test",
        learning_rate=0.0002,
        num_train_epochs=1,
        logging_steps=100,
        do_eval=False,
        remove_unused_columns=False,
    )
    collator = DataCollatorWithPadding(
        feature_name_to_padding_value={
            "input_ids": tokenizer.pad_token_id,
            "attention_mask": 0,
            **{key.name: -100 for key in head_configs},
        }
    )
    trainer = Trainer(model, args=args, train_dataset=dd["train"], data_collator=collator)
    trainer.train()
    _, by_head = evaluate_head_wise(model, dd["validation"], collator, epochs=1)
    assert set(by_head) == {c.name for c in head_configs}  # one loss per hooked layer
    assert torch.equal(model.heads["lm_head"].output_projection().weight, lm_before)  # frozen
    top = get_top_n_preds(5, model, "w1 w2 good", tokenizer)
    assert set(top) == set(by_head)


@pytest.mark.parametrize("full_finetune", [False, True], ids=["linear_probe", "full_finetune"])
def test_text_classification(hub, full_finetune):
    model_path = hub["gpt2"]
    num_heads = 6 if not full_finetune else 2
    model_params = get_model_params(model_path)
    model_class = model_params["model_class"]
    hidden_size = model_params["hidden_size"]
    head_configs = [
        HeadConfig(
            name=f"imdb_head_{(1 + (i - 1) * 2)}",
            layer_hook=-(1 + (i - 1) * 2),
            in_size=hidden_size,
            output_activation="linear",
            pred_for_sequence=True,
            loss_fct="cross_entropy",
            num_outputs=2,
        )
        for i in range(1, num_heads + 2)
    ]
    dd = load_dataset("imdb")
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    def tokenize_function(examples):
        out = tokenizer(examples["text"], padding=False, truncation=True)
        for hc in head_configs:
            out[hc.name] = examples["label"]
        return out

    for split in dd.keys():
        dd[split] = dd[split].filter(function=lambda example: len(example["text"]) > 10)
        dd[split] = dd[split].shuffle(seed=0)
        dd[split] = dd[split].map(tokenize_function, batched=True)
    dd.set_format(
        type="torch", columns=["input_ids", "attention_mask"] + [x.name for x in head_configs]
    )
    for split in dd.keys():
        dd[split] = dd[split].remove_columns(["text", "label"])
    model = load_headed(
        model_class,
        model_path,
        head_configs=head_configs,
        quantization_config=None,  # was: None if full_finetune else quantization_config
        freeze_base_model=not full_finetune,
        device_map="cpu",
    )
    assert any(p.requires_grad for p in model.backbone.parameters()) == full_finetune
    ins, preds, ground_truths = get_some_preds(
        model, dd["test"], tokenizer, n=5, classification=True
    )
    table = pd.DataFrame(
        list(zip(ins, preds["imdb_head_5"], ground_truths["imdb_head_5"])),
        columns=["review", "label", "ground_truth"],
    )
    assert len(table) == 5 and set(table["label"]) <= {0, 1}
    assert list(table["ground_truth"]) == [int(x) for x in dd["test"]["imdb_head_5"][:5]]
    collator = DataCollatorWithPadding(
        feature_name_to_padding_value={"input_ids": tokenizer.pad_token_id, "attention_mask": 0}
    )
    before = evaluate_head_wise(model, dd["test"], collator, epochs=1)
    args = training_args(
        output_dir="imdb_linear_probe",
        learning_rate=0.0002,
        num_train_epochs=1,
        logging_steps=100,
        do_eval=False,
        remove_unused_columns=False,
    )
    trainer = Trainer(model, args=args, train_dataset=dd["train"], data_collator=collator)
    trainer.train()
    after = evaluate_head_wise(model, dd["test"], collator, epochs=1)
    assert set(after[1]) == {c.name for c in head_configs} and after != before
