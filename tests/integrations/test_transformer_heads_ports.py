"""Reduced ports of transformer-heads' CPU-runnable test files (``test_load_model``,
``test_loss_compute``, ``test_lm_head_consistency``, ``test_generate``, ``test_gradients``,
``test_evaluate``): its code as written plus only docs/migrating.md's renames, on the
prelude's tiny models (tests/th_ports.py); 4-bit loading becomes quantization_config=None on
the CPU, ``attn_implementation="flash_attention_2"`` (CUDA) is dropped, and where it printed,
the port asserts."""

# ruff: noqa: SIM118  (its notebooks' code as written: `for split in dd.keys()`)
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from th_ports import load_dataset, tiny_hub
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from headkit.compat import (
    DataCollatorWithPadding,
    HeadConfig,
    HeadedModelGenerateOutput,
    HeadedModelOutput,
    compare_all_params,
    create_headed_qlora,
    evaluate_head_wise,
    get_model_params,
    get_multi_head_transformer,
    load_headed,
    load_lora_with_heads,
    print_trainable_parameters,
)

pytestmark = pytest.mark.usefixtures("single_thread")
HIDDEN = 32  # its in_size=4096 is Mistral's hidden size; the tiny models' is 32


def heads(vocab: int) -> list[HeadConfig]:
    return [
        HeadConfig(
            name="lm_head",
            layer_hook=-1,
            in_size=HIDDEN,
            hidden_size=0,
            num_layers=1,
            output_activation="linear",
            is_causal_lm=True,
            loss_fct="cross_entropy",
            is_regression=False,
            output_bias=False,
            num_outputs=vocab,
        ),
        HeadConfig(
            name="classification_hook",
            layer_hook=-4,
            in_size=HIDDEN,
            hidden_size=1024,
            num_layers=2,
            output_activation="linear",
            is_causal_lm=False,
            loss_fct="cross_entropy",
            num_outputs=2,
            is_regression=False,
            output_bias=False,
            target="classes",
        ),
        HeadConfig(
            name="classify_seq",
            layer_hook=-4,
            in_size=HIDDEN,
            hidden_size=1024,
            num_layers=2,
            output_activation="linear",
            is_causal_lm=False,
            loss_fct="cross_entropy",
            num_outputs=2,
            pred_for_sequence=True,
            is_regression=False,
            output_bias=False,
            target="seq",
        ),
        HeadConfig(
            name="regression_hook",
            layer_hook=-6,
            in_size=HIDDEN,
            hidden_size=0,
            num_layers=1,
            output_activation="linear",
            is_causal_lm=False,
            loss_fct="mse",
            num_outputs=1,
            is_regression=True,
            output_bias=False,
        ),
    ]


@pytest.fixture
def model_path(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch) -> str:
    monkeypatch.chdir(tmp_path)
    return tiny_hub(tmp_path_factory.getbasetemp() / "hub")["mistralai/Mistral-7B-v0.1"]


def check_consistency(outputs1: HeadedModelOutput, outputs2: HeadedModelOutput):
    for key in outputs1.preds_by_head:
        probs1 = torch.softmax(outputs1.preds_by_head[key][0], dim=-1)
        probs2 = torch.softmax(outputs2.preds_by_head[key][0], dim=-1)
        assert probs1.allclose(probs2, atol=1e-4, rtol=1e-3), key


def get_test_inputs(device, model_path):
    tk = AutoTokenizer.from_pretrained(model_path)
    inputs = tk("w1 w2 w3 good", return_tensors="pt")
    inputs["classes"] = torch.ones_like(inputs["input_ids"])
    inputs["seq"] = torch.tensor(1)  # one example's label, 0-dim
    inputs["regression_hook"] = torch.zeros_like(inputs["input_ids"])
    inputs["lm_head"] = torch.ones_like(inputs["input_ids"])
    inputs.to(device)
    return tk, inputs


def test_load_model(model_path):
    params = get_model_params(model_path)
    hs = heads(params["vocab_size"])
    model = load_headed(params["model_class"], model_path, hs, device_map="cpu")
    tk, inputs = get_test_inputs(model.device, model_path=model_path)
    outputs: HeadedModelOutput = model(**inputs)
    assert set(outputs["loss_by_head"]) == {
        "lm_head",
        "classification_hook",
        "classify_seq",
        "regression_hook",
    }
    model.save_pretrained("headed_model")
    del model
    model = get_multi_head_transformer(params["model_class"]).from_pretrained(
        "headed_model", device_map="cpu"
    )
    new_outputs: HeadedModelOutput = model(**inputs)
    check_consistency(outputs, new_outputs)


def test_qlora(model_path, capsys):
    params = get_model_params(model_path)
    hs = heads(params["vocab_size"])
    quantization_config = None  # CUDA only: BitsAndBytesConfig(load_in_4bit=True, ...)
    lora_config = LoraConfig(
        r=64,
        lora_alpha=16,
        target_modules=None,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = create_headed_qlora(
        params["model_class"],
        model_path,
        quantization_config=quantization_config,
        lora_config=lora_config,
        head_configs=hs,
        device_map="cpu",
        torch_dtype=torch.float32,
    )
    print_trainable_parameters(model, use_4bit=False)
    tk, inputs = get_test_inputs(model.device, model_path=model_path)
    outputs: HeadedModelOutput = model(**inputs)
    model.save_pretrained("headed_model_qlora")
    model_loaded = load_lora_with_heads(
        params["model_class"],
        "headed_model_qlora",
        quantization_config,
        device_map="cpu",
        only_inference=False,
        torch_dtype=torch.float32,
    )
    print_trainable_parameters(model_loaded, use_4bit=False)
    first, second = capsys.readouterr().out.splitlines()[::3][:2]
    assert first == second  # the same parameters, trainable as before
    assert compare_all_params(model, model_loaded) == []
    new_outputs: HeadedModelOutput = model_loaded(**inputs)
    check_consistency(outputs, new_outputs)


def test_loss_compute_and_adaptive_loss(model_path):
    model_params = get_model_params(model_path)
    model = load_headed(
        model_params["model_class"], model_path, heads(model_params["vocab_size"]), device_map="cpu"
    )
    model.set_loss_weighting("adaptive")  # was model.set_adaptive_loss(True)
    model.train()
    tk = AutoTokenizer.from_pretrained(model_path)
    for _ in range(7):
        inputs = tk(["w1 w2 w3 w4 good", "w5 w6"], return_tensors="pt", padding=True)
        b, s = inputs["input_ids"].shape
        inputs["classes"] = torch.randint(low=0, high=2, size=(b, s))
        inputs["seq"] = torch.randint(low=0, high=2, size=(b,))
        inputs["regression_hook"] = torch.rand((b, s))
        inputs["lm_head"] = torch.randint(low=0, high=100, size=(b, s))
        outputs = model(**inputs)
        assert outputs["loss"].requires_grad
        assert set(outputs["adapted_loss_by_head"]) == set(outputs["loss_by_head"])


def test_lm_head_consistency(model_path):
    tk = AutoTokenizer.from_pretrained(model_path)
    input_ids = tk.encode("w1 w2 good w3", return_tensors="pt")
    params = get_model_params(model_path)
    th_model = load_headed(
        params["model_class"],
        model_path,
        heads(100)[:1],
        device_map="cpu",
        quantization_config=None,
        torch_dtype=torch.float32,
    )
    base_model = AutoModelForCausalLM.from_pretrained(
        model_path, device_map="cpu", torch_dtype=torch.float32
    )
    th_model.eval()
    base_model.eval()
    with torch.no_grad():
        assert compare_all_params(th_model.model, base_model.model) == []
        th_output = th_model.model(input_ids, output_hidden_states=True)
        base_output = base_model.model(input_ids, output_hidden_states=True)
        assert torch.equal(th_output.last_hidden_state, base_output.last_hidden_state)
        th_preds = th_model(input_ids, output_hidden_states=True).preds_by_head["lm_head"]
        assert torch.allclose(th_preds, base_model(input_ids).logits, atol=1e-5)
    generation_config = GenerationConfig(do_sample=False, max_new_tokens=8)
    th_seq = th_model.generate(input_ids, generation_config=generation_config).sequences
    base_seq = base_model.generate(input_ids, generation_config=generation_config)
    assert torch.equal(th_seq, base_seq)


def test_generate(model_path):
    hs = [heads(100)[0], heads(100)[3]]
    model_params = get_model_params(model_path)
    lora_config = LoraConfig(
        r=64,
        lora_alpha=16,
        target_modules=None,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = create_headed_qlora(
        base_model_class=model_params["model_class"],
        head_configs=hs,
        model_name=model_path,
        quantization_config=None,
        lora_config=lora_config,
        device_map="cpu",
    )
    tk = AutoTokenizer.from_pretrained(model_path)
    inputs = tk.encode("w1 w2 good w3", return_tensors="pt")
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=10)
    generation_output: HeadedModelGenerateOutput = model.generate(
        inputs.to(model.device), generation_config=gen_config
    )
    n = generation_output.sequences.shape[1] - inputs.shape[1]
    assert generation_output.logprobs.shape == (1, n)
    assert generation_output.head_outputs["regression_hook"].shape == (1, n, 1)
    torch.manual_seed(0)
    gen_config = GenerationConfig(do_sample=True, max_new_tokens=10, temperature=1.0, top_k=50)
    sampled = model.generate(inputs.to(model.device), generation_config=gen_config)
    assert (sampled.logprobs <= 0).all()


def test_gradients(model_path):
    value_head = HeadConfig(
        name="value_head",
        layer_hook=-1,
        in_size=HIDDEN,
        hidden_size=1024,
        num_layers=2,
        output_activation="linear",
        is_causal_lm=False,
        loss_fct="masked_mse",
        num_outputs=1,
        is_regression=False,
        output_bias=False,
        target="values",
    )
    params = get_model_params(model_path)
    lora_config = LoraConfig(
        r=64,
        lora_alpha=16,
        target_modules=None,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = create_headed_qlora(
        params["model_class"],
        model_path,
        quantization_config=None,
        lora_config=lora_config,
        head_configs=[value_head],
        device_map="cpu",
        torch_dtype=torch.float32,
    )
    data = {
        "input_ids": torch.tensor([[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]]),
        "values": torch.tensor([[0, 1, 0, 0.2, -100], [0.2, 0.3, 0.1, -100, -100]]).unsqueeze(-1),
    }
    outputs: HeadedModelOutput = model(**data)
    outputs.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_B" in n for n in grads) and all(
        g is not None and torch.isfinite(g).all() for g in grads.values()
    )


def test_evaluate(model_path):
    model_params = get_model_params(model_path)
    hidden_size, vocab_size = model_params["hidden_size"], model_params["vocab_size"]
    head_configs = [
        HeadConfig(
            name="sentiment_head",
            layer_hook=-4,
            in_size=hidden_size,
            output_activation="linear",
            pred_for_sequence=True,
            loss_fct="cross_entropy",
            num_outputs=2,
            loss_weight=2.0,
        ),
        HeadConfig(
            name="causal_lm",
            layer_hook=-1,
            in_size=hidden_size,
            output_activation="linear",
            is_causal_lm=True,
            loss_fct="cross_entropy",
            num_outputs=vocab_size,
            loss_weight=1.0,
        ),
        HeadConfig(
            name="num_tokens_regression",
            layer_hook=-7,
            hidden_size=128,
            num_layers=3,
            in_size=hidden_size,
            output_activation="linear",
            pred_for_sequence=False,
            loss_fct="mse",
            num_outputs=1,
            is_regression=True,
            loss_weight=0.0002,
        ),
    ]
    dd = load_dataset("imdb")
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    def processing_function(examples):
        out = tokenizer(examples["text"], padding=False, truncation=True)
        out["sentiment_head"] = examples["label"]
        out["causal_lm"] = out["input_ids"].copy()
        out["num_tokens_regression"] = [
            list(map(float, range(len(ids) - 1, -1, -1))) for ids in out["input_ids"]
        ]
        return out

    for split in dd.keys():
        dd[split] = dd[split].map(processing_function, batched=True)
    dd.set_format(
        type="torch", columns=["input_ids", "attention_mask"] + [x.name for x in head_configs]
    )
    for split in dd.keys():
        dd[split] = dd[split].remove_columns(["text", "label"])
    lora_config = LoraConfig(
        r=32,
        lora_alpha=16,
        target_modules=None,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = create_headed_qlora(
        base_model_class=model_params["model_class"],
        model_name=model_path,
        quantization_config=None,
        lora_config=lora_config,
        head_configs=head_configs,
        fully_trained_heads=True,
        device_map="cpu",
        gradient_checkpointing=True,
    )
    collator = DataCollatorWithPadding(
        feature_name_to_padding_value={
            "input_ids": tokenizer.pad_token_id,
            "attention_mask": 0,
            "causal_lm": -100,
            "num_tokens_regression": 0,
        }
    )
    loss, by_head = evaluate_head_wise(model, dd["test"], collator, epochs=0.04, batch_size=4)
    assert set(by_head) == {c.name for c in head_configs}
    expected = sum(c.loss_weight * by_head[c.name] for c in head_configs)  # one batch: exact
    assert loss == pytest.approx(expected, rel=1e-5)
