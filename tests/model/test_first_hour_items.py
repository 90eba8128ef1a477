"""Small things a practitioner meets in the first hour: token_type_ids a model cannot take,
pipelines naming the recorded classes, the collator's ``labels`` with one head, a corrupt
image named by its file and row, and the heads file's size in the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import build_tiny
from transformers import pipeline

from headkit import BatchError, HeadConfig, HeadedCollator, HeadedModel, load_headed
from headkit.cli.main import main
from headkit.packaged import minilm_path

pytestmark = pytest.mark.usefixtures("single_thread")
ROOT = Path(__file__).resolve().parents[2]
HEAD = HeadConfig("c", num_outputs=2, pred_for_sequence=True)


@pytest.mark.parametrize("arch", ["t5", "llama"])
def test_token_type_ids_a_model_cannot_take_are_refused(arch):
    model = HeadedModel(build_tiny(arch, num_layers=2), [HEAD])
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(BatchError, match=r"token_type_ids were given, but \w+ takes none"):
        model(input_ids=ids, token_type_ids=torch.zeros_like(ids))
    model(input_ids=ids)  # without them: fine


def test_token_type_ids_still_reach_a_model_that_takes_them():
    model = HeadedModel(build_tiny("bert", num_layers=2), [HEAD]).eval()
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        a = model(input_ids=ids, token_type_ids=torch.zeros_like(ids)).logits
        b = model(input_ids=ids, token_type_ids=torch.ones_like(ids)).logits
    assert not torch.equal(a, b)


def test_a_text_classification_pipeline_names_the_recorded_classes(minilm_tokenizer):
    head = HeadConfig(
        "sentiment",
        num_outputs=2,
        pred_for_sequence=True,
        pooling="mean",
        extra={"classes": ["rotten", "fresh"]},
    )
    model = load_headed(minilm_path(), head_configs=[head]).eval()
    assert model.config.id2label == {0: "rotten", 1: "fresh"}
    classify = pipeline("text-classification", model=model, tokenizer=minilm_tokenizer, top_k=None)
    texts = ["A warm and funny film.", "Dull."]
    batch = minilm_tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        probs = model(**batch).logits.softmax(-1)
    for row, p in zip(classify(texts), probs):
        scores = {r["label"]: r["score"] for r in row}
        assert set(scores) == {"rotten", "fresh"}
        assert scores["fresh"] == pytest.approx(float(p[1]), abs=1e-5)


def test_names_a_backbone_config_gives_are_kept():
    bert = build_tiny("bert", num_layers=2)
    bert.config.id2label = {0: "neg", 1: "pos"}
    cfg = HeadConfig("c", num_outputs=2, pred_for_sequence=True, extra={"classes": ["a", "b"]})
    assert HeadedModel(bert, [cfg]).config.id2label == {0: "neg", 1: "pos"}


def test_one_heads_labels_are_a_plain_tensor_as_the_docs_say():
    model = HeadedModel(build_tiny("bert", num_layers=2), [HEAD])
    batch = HeadedCollator(model)([{"input_ids": [5, 6], "c": 1}, {"input_ids": [7], "c": 0}])
    assert torch.equal(batch["labels"], torch.tensor([1, 0]))  # as DataCollatorWithPadding
    two = HeadedModel(build_tiny("bert", num_layers=2), [HEAD, HeadConfig("d", num_outputs=3)])
    batch = HeadedCollator(two)([{"input_ids": [5, 6], "c": 1, "d": [0, 2]}])
    assert set(batch["labels"]) == {"c", "d"}  # several heads: {target: tensor}
    docs = (ROOT / "docs" / "training.md").read_text()
    assert "with one head that has a loss, that head's tensor" in " ".join(docs.split())


def test_a_corrupt_image_is_named_with_its_file_and_row(tmp_path, capsys):
    from PIL import Image

    Image.new("RGB", (8, 8), "red").save(tmp_path / "ok.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really an image")
    rows = "\n".join(f"{'broken' if i == 9 else 'ok'}.png,{i % 2}" for i in range(12))
    (tmp_path / "d.csv").write_text("image,label\n" + rows + "\n")
    args = ["probe", "--model", "packaged:minilm", "--data", str(tmp_path / "d.csv")]
    args += ["--image-column", "image", "--output", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "--image-column image: row 10 of" in err and "(line 11, after the header)" in err
    assert "broken.png" in err and "is not a readable image" in err
    assert len(err.splitlines()) == 1


def test_the_readmes_heads_file_size_is_what_a_save_writes(tmp_path):
    readme = (ROOT / "README.md").read_text()
    stated = int(re.search(r"heads-\*\.safetensors \((\d+) KB\)", readme).group(1))
    model = load_headed(
        minilm_path(),
        head_configs=[
            HeadConfig("sentiment", num_outputs=2, pred_for_sequence=True, pooling="mean"),
            HeadConfig("pos", layer_hook=2, num_outputs=17),
        ],
    )
    model.save_pretrained(tmp_path)
    (weights,) = tmp_path.glob("heads-*.safetensors")
    assert round(weights.stat().st_size / 1000) == stated
