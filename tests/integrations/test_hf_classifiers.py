"""A head as a plain transformers classifier: the folder loads with the Auto classes offline
and gives the head's predictions; every head no such class computes is refused by name."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml
from conftest import build_tiny
from transformers import (
    AutoModel,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    pipeline,
)

import headkit
from headkit import ConfigError, HeadConfig, HeadedModel
from headkit.integrations.hf_classifiers import SIDECAR, export_transformers
from headkit.packaged import minilm_path

pytestmark = pytest.mark.usefixtures("single_thread")

PAD = 0  # a pad id of its own (the tiny decoders' default pad is their eos)


def right_padded(pad: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 2:] = 0
    return {"input_ids": torch.where(mask.bool(), ids, pad), "attention_mask": mask}


def load_and_compare(model, head, folder, auto, pad):
    loaded = auto.from_pretrained(folder, trust_remote_code=False, local_files_only=True).eval()
    batch = right_padded(pad)
    with torch.no_grad():
        ours, theirs = model(**batch).preds_by_head[head], loaded(**batch).logits
    keep = batch["attention_mask"].bool()
    if ours.dim() == 3:
        ours, theirs = ours[keep], theirs[keep]
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    return loaded


@pytest.mark.parametrize(
    ("arch", "head", "auto"),
    [
        ("gpt2", HeadConfig("s", num_outputs=3, pred_for_sequence=True), "seq"),
        ("llama", HeadConfig("s", num_outputs=2, pred_for_sequence=True), "seq"),
        ("bert", HeadConfig("s", num_outputs=2, pred_for_sequence=True, pooling="pooler"), "seq"),
        (
            "roberta",
            HeadConfig(
                "s",
                num_outputs=2,
                pred_for_sequence=True,
                pooling="first",
                num_layers=2,
                hidden_size=32,
                hidden_activation="tanh",
                output_bias=True,
            ),
            "seq",
        ),
        (
            "distilbert",
            HeadConfig(
                "s",
                num_outputs=2,
                pred_for_sequence=True,
                pooling="first",
                num_layers=2,
                hidden_size=32,
                hidden_activation="relu",
            ),
            "seq",
        ),
        ("gpt2", HeadConfig("t", num_outputs=4), "tok"),
        ("llama", HeadConfig("t", num_outputs=4, output_bias=True), "tok"),
        ("bert", HeadConfig("t", num_outputs=4), "tok"),
    ],
)
def test_the_folder_loads_as_a_plain_classifier_with_the_same_logits(tmp_path, arch, head, auto):
    decoder = arch in ("gpt2", "llama")
    overrides = {"pad_token_id": PAD} if decoder else {}
    model = HeadedModel(build_tiny(arch, num_layers=2, **overrides), [head]).eval()
    result = headkit.export(model, tmp_path, format="transformers")
    cls = AutoModelForSequenceClassification if auto == "seq" else AutoModelForTokenClassification
    pad = PAD if decoder else model.backbone.config.pad_token_id
    loaded = load_and_compare(model, head.name, tmp_path, cls, pad)
    assert result.model_class == type(loaded).__name__ and result.max_abs_diff <= 1e-4
    if decoder and auto == "seq":
        assert loaded.config.pad_token_id == PAD


def test_minilm_pooler_head_in_a_text_classification_pipeline(tmp_path, minilm_tokenizer):
    torch.manual_seed(0)
    head = HeadConfig(
        "sentiment",
        num_outputs=2,
        pred_for_sequence=True,
        pooling="pooler",
        extra={"classes": ["rotten", "fresh"]},
    )
    model = HeadedModel(AutoModel.from_pretrained(minilm_path()), [head]).eval()
    result = export_transformers(model, tmp_path, tokenizer=minilm_tokenizer)
    assert json.loads((tmp_path / SIDECAR).read_text())["head"] == "sentiment"
    classify = pipeline("text-classification", model=str(tmp_path), device="cpu", top_k=None)
    texts = ["A warm and funny film.", "Two hours I will never get back, sadly."]
    got = classify(texts)
    batch = minilm_tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        probs = model(**batch).preds_by_head["sentiment"].softmax(-1)
    for row, p in zip(got, probs):
        scores = {r["label"]: r["score"] for r in row}
        assert set(scores) == {"rotten", "fresh"}
        assert scores["fresh"] == pytest.approx(float(p[1]), abs=1e-5)
    assert result.auto_class == "AutoModelForSequenceClassification"
    # the export carries its own card: a transformers model, its pipeline, the base model
    card = (tmp_path / "README.md").read_text()
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-classification"
    assert meta["base_model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert meta["license"] == "apache-2.0"
    assert "AutoModelForSequenceClassification.from_pretrained(" in card
    assert "## Intended use" in card and "## Limitations" in card
    # a card the user edits is theirs: a later export neither replaces nor deletes it
    (tmp_path / "README.md").write_text(card + "\nMy notes.\n")
    export_transformers(model, tmp_path, tokenizer=minilm_tokenizer, overwrite=True)
    assert (tmp_path / "README.md").read_text().endswith("My notes.\n")
    assert "card_sha256" not in json.loads((tmp_path / SIDECAR).read_text())


def test_one_head_of_several_is_exported_when_named(tmp_path):
    heads = [
        HeadConfig("tags", num_outputs=3),
        HeadConfig("mood", num_outputs=2, pred_for_sequence=True, pooling="pooler"),
    ]
    model = HeadedModel(build_tiny("bert", num_layers=2), heads).eval()
    with pytest.raises(ConfigError, match=r"has 2 heads \(tags, mood\).*pass head=NAME"):
        export_transformers(model, tmp_path)
    export_transformers(model, tmp_path, head="mood", labels=["sad", "glad"])
    loaded = load_and_compare(model, "mood", tmp_path, AutoModelForSequenceClassification, 0)
    assert loaded.config.id2label == {0: "sad", 1: "glad"}


@pytest.mark.parametrize(
    ("arch", "head", "reasons"),
    [
        (
            "gpt2",
            HeadConfig(
                "s",
                num_outputs=2,
                pred_for_sequence=True,
                pooling="mean",
                layer_hook=1,
                output_bias=True,
                output_activation="softmax",
            ),
            [
                r"reads layer_hook=1",
                r"output_activation is 'softmax'",
                r"has a bias",
                r"pools with 'mean'; this classifier takes pooling='last'",
            ],
        ),
        (
            "bert",
            HeadConfig("s", num_outputs=2, pred_for_sequence=True, pooling="first"),
            [r"pools with 'first'; this classifier takes pooling='pooler'"],
        ),
        (
            "bert",
            HeadConfig("t", num_outputs=2, num_layers=2, hidden_size=8),
            [r"2 Linear layers; the token classifiers have one"],
        ),
        ("gpt2", HeadConfig("lm_head", is_causal_lm=True), [r"causal-LM head"]),
        (
            "bloom",
            HeadConfig("s", num_outputs=2, pred_for_sequence=True, pooling="last"),
            [r"there is no pad_token_id"],
        ),
    ],
)
def test_heads_no_class_computes_are_refused_naming_why(tmp_path, arch, head, reasons):
    model = HeadedModel(build_tiny(arch, num_layers=2), [head])
    with pytest.raises(ConfigError, match=r"cannot be exported as a plain transformers") as e:
        export_transformers(model, tmp_path)
    for reason in reasons:
        assert re.search(reason, str(e.value)), (reason, e.value)
    assert "format='onnx'" in str(e.value)
    assert not list(tmp_path.iterdir())


def test_a_decoder_whose_pad_is_its_eos_is_refused_and_an_own_pad_id_works(tmp_path):
    head = HeadConfig("s", num_outputs=2, pred_for_sequence=True)
    model = HeadedModel(build_tiny("gpt2", num_layers=2), [head]).eval()  # pad == eos == 2
    with pytest.raises(ConfigError, match=r"pad_token_id=2 is also the eos id.*right-most id"):
        export_transformers(model, tmp_path)
    export_transformers(model, tmp_path, pad_token_id=PAD)
    load_and_compare(model, "s", tmp_path, AutoModelForSequenceClassification, PAD)
