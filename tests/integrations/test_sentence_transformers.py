"""sentence-transformers in and out, with the packaged all-MiniLM-L6-v2.

In: a ``SentenceTransformer`` (or the folder of a saved one) is a backbone, and
``model(**st.tokenize(texts))`` works. Out: ``to_sentence_transformer`` turns a sequence head
into a SentenceTransformer whose ``encode`` returns the head's predictions, and which saves
and loads with sentence-transformers' own modules (offline, no trust_remote_code).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny
from sentence_transformers import SentenceTransformer

from headkit import ConfigError, HeadConfig, HeadedModel, load_headed, to_sentence_transformer
from headkit.packaged import minilm_path

pytestmark = pytest.mark.usefixtures("single_thread")

TEXTS = [
    "a gorgeous, witty film",
    "dull",
    "the plot is thin, but the acting is great fun to watch",
]
POOLINGS = ["mean", "first", "max", "last", "mean_sqrt_len", "weighted_mean"]


@pytest.fixture(scope="module")
def st(minilm_st) -> SentenceTransformer:
    """The session's SentenceTransformer of the packaged MiniLM (Transformer → Pooling →
    Normalize); the models below only read it."""
    return minilm_st


def _head(pooling: str, **kw) -> HeadConfig:
    return HeadConfig(
        f"h_{pooling}",
        num_outputs=4,
        pred_for_sequence=True,
        pooling=pooling,
        num_layers=2,
        hidden_size=8,
        hidden_activation="gelu",
        output_activation="tanh",
        **kw,
    )


@pytest.fixture(scope="module")
def headed(st) -> HeadedModel:
    """A HeadedModel over the SentenceTransformer, one two-layer head per pooling."""
    torch.manual_seed(0)
    return HeadedModel(st, [_head(p) for p in POOLINGS]).eval()


# ---------------------------------------------------------------------- in
def test_a_sentence_transformer_is_a_backbone_and_its_tokenize_output_is_accepted(st, headed):
    assert headed.backbone is st[0].auto_model
    batch = st.tokenize(TEXTS)
    plain = st.tokenizer(TEXTS, padding=True, return_tensors="pt")
    assert set(batch) - set(plain) <= {"modality"}  # sentence-transformers 6 adds "modality"
    with torch.no_grad():
        out = headed(**batch)
        ref = headed(**plain)
    for name in headed.heads:
        assert torch.equal(out.preds_by_head[name], ref.preds_by_head[name])


def test_load_headed_takes_a_sentence_transformer_or_its_folder(st, tmp_path: Path):
    head = [HeadConfig("sent", num_outputs=2, pred_for_sequence=True, pooling="mean")]
    assert load_headed(st, head_configs=head).backbone is st[0].auto_model
    from_folder = load_headed(str(minilm_path()), head_configs=head)
    assert type(from_folder.backbone).__name__ == "BertModel"
    # a saved model whose Transformer module lives in a subfolder (older layout)
    tiny = build_tiny("bert", num_layers=1)
    tiny.save_pretrained(tmp_path / "0_Transformer")
    kinds = [("0_Transformer", "Transformer"), ("1_Pooling", "Pooling")]
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(kinds)
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    loaded = load_headed(str(tmp_path), head_configs=head)
    (tmp_path / "modules.json").write_text(json.dumps(modules[1:]))
    with pytest.raises(ConfigError, match=r"modules.json lists no Transformer module"):
        load_headed(str(tmp_path), head_configs=head)
    assert loaded.info.hidden_size == 32
    assert torch.equal(
        loaded.backbone.embeddings.word_embeddings.weight, tiny.embeddings.word_embeddings.weight
    )


# ---------------------------------------------------------------------- out
@pytest.mark.parametrize("pooling", POOLINGS)
def test_an_exported_head_encodes_like_headkit_predicts(st, headed, pooling):
    name = f"h_{pooling}"
    exported = to_sentence_transformer(headed, name, st.tokenizer)
    assert [type(m).__name__ for m in exported] == ["Transformer", "Pooling", "Dense", "Dense"]
    encoded = exported.encode(TEXTS, convert_to_tensor=True)
    with torch.no_grad():
        preds = headed(**st.tokenizer(TEXTS, padding=True, return_tensors="pt")).preds_by_head
    torch.testing.assert_close(encoded, preds[name], atol=1e-5, rtol=0)


def test_an_exported_model_saves_and_loads_offline(st, headed, tmp_path: Path):
    exported = to_sentence_transformer(headed, "h_mean", st.tokenizer)
    exported.save(str(tmp_path / "exported"))
    again = SentenceTransformer(str(tmp_path / "exported"), device="cpu")  # no trust_remote_code
    with torch.no_grad():
        preds = headed(**st.tokenizer(TEXTS, padding=True, return_tensors="pt")).preds_by_head
    torch.testing.assert_close(
        again.encode(TEXTS, convert_to_tensor=True), preds["h_mean"], atol=1e-5, rtol=0
    )


def test_heads_sentence_transformers_cannot_express_are_refused(st):
    heads = [
        HeadConfig("tok", num_outputs=3),
        HeadConfig("mid", layer_hook=3, num_outputs=3, pred_for_sequence=True, pooling="mean"),
        HeadConfig("pool", num_outputs=3, pred_for_sequence=True, pooling="pooler"),
        HeadConfig("both", num_outputs=3, pred_for_sequence=True, pooling="mean+max"),
        HeadConfig("soft", num_outputs=3, pred_for_sequence=True, output_activation="softmax"),
    ]
    model = HeadedModel(st, heads)
    cases = {
        "tok": r"head 'tok' is a token head",
        "mid": r"head 'mid' reads layer_hook=3; .* only a head on layer_hook=-1",
        "pool": r"head 'pool' pools with 'pooler'; sentence-transformers has",
        "both": r"head 'both' pools with 'mean\+max'",
        "soft": r"activation 'softmax' .* has arguments",
        "nope": r"head='nope' is not a head of this model",
    }
    for head, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            to_sentence_transformer(model, head, st.tokenizer)
