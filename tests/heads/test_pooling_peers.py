"""headkit's sequence heads reproduce the real peers exactly.

- ``BertForSequenceClassification``: pooling="pooler" + the peer's classifier weights.
- ``GPT2ForSequenceClassification`` / ``LlamaForSequenceClassification``: pooling="last" +
  the peer's ``score`` weights, with right padding, left padding and pad == eos.
- sentence-transformers all-MiniLM-L6-v2: Transformer → Pooling(mean) (before Normalize)
  equals pooling="mean" on layer -1 of the packaged model; its Pooling module's other modes
  equal headkit's strategies of the same meaning, for both padding sides.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny
from transformers import PreTrainedModel

from headkit import HeadConfig, HeadedModel

NUM_LABELS = 3
PAD = 0


def _seq_head(pooling: str, output_bias: bool, **kw) -> HeadConfig:
    return HeadConfig(
        name="cls",
        pred_for_sequence=True,
        pooling=pooling,
        num_outputs=NUM_LABELS,
        output_bias=output_bias,
        **kw,
    )


def _copy_linear(dst: torch.nn.Linear, src: torch.nn.Linear) -> None:
    with torch.no_grad():
        dst.weight.copy_(src.weight)
        if src.bias is not None:
            dst.bias.copy_(src.bias)


def _padded(seqs: list[list[int]], side: str, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), seq), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), seq, dtype=torch.long)
    for b, s in enumerate(seqs):
        where = slice(0, len(s)) if side == "right" else slice(seq - len(s), seq)
        ids[b, where] = torch.tensor(s)
        mask[b, where] = 1
    return ids, mask


def _random_seqs(lengths: list[int], seed: int, low: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, 100, (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------------- BERT
def test_bert_pooler_head_equals_bert_for_sequence_classification() -> None:
    peer = build_tiny("bert", num_layers=2, task="sequence-classification", num_labels=NUM_LABELS)
    model = HeadedModel(peer, [_seq_head("pooler", output_bias=True)]).eval()
    _copy_linear(model.heads["cls"].linears[0], peer.classifier)
    ids, mask = _padded(_random_seqs([7, 3, 1, 5], seed=1), "right", PAD)
    types = torch.zeros_like(ids)
    types[:, 2:] = 1
    labels = torch.tensor([0, 2, 1, 2])
    with torch.no_grad():
        want = peer(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
        got = model(input_ids=ids, attention_mask=mask, token_type_ids=types, cls=labels)
    torch.testing.assert_close(got.preds_by_head["cls"], want.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- decoders
def _peer(arch: str, pad: int, eos: int) -> PreTrainedModel:
    """A tiny ``arch``ForSequenceClassification whose pad and eos ids are ``pad`` and ``eos``."""
    return build_tiny(
        arch,
        num_layers=2,
        task="sequence-classification",
        num_labels=NUM_LABELS,
        pad_token_id=pad,
        eos_token_id=eos,
    )


PEERS = ("gpt2", "llama")


def _headed(peer) -> HeadedModel:
    model = HeadedModel(peer, [_seq_head("last", output_bias=False)]).eval()
    _copy_linear(model.heads["cls"].linears[0], peer.score)
    return model


def _compare(peer, model: HeadedModel, ids: torch.Tensor, mask: torch.Tensor) -> None:
    # The position ids headkit derives for decoders (left padding = unpadded positions).
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = peer(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = model(input_ids=ids, attention_mask=mask).preds_by_head["cls"]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("arch", PEERS)
def test_last_token_head_equals_decoder_for_sequence_classification(arch: str, side: str) -> None:
    peer = _peer(arch, pad=PAD, eos=2)
    model = _headed(peer)
    ids, mask = _padded(_random_seqs([6, 2, 1, 4], seed=2), side, PAD)
    _compare(peer, model, ids, mask)
    if side == "right":  # the peer's own default positions agree at every real token
        with torch.no_grad():
            want = peer(input_ids=ids, attention_mask=mask).logits
            got = model(input_ids=ids, attention_mask=mask).preds_by_head["cls"]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("arch", PEERS)
def test_pad_equal_to_eos_inside_the_text(arch: str, side: str) -> None:
    """pad == eos, with eos used as a separator inside real text: both still agree."""
    eos = 2
    peer = _peer(arch, pad=eos, eos=eos)
    model = _headed(peer)
    seqs = _random_seqs([6, 3, 5], seed=3)
    seqs[0][2] = eos
    seqs[2][1] = eos
    ids, mask = _padded(seqs, side, eos)
    _compare(peer, model, ids, mask)


@pytest.mark.parametrize("arch", PEERS)
def test_pad_equal_to_eos_at_the_end_headkit_pools_the_real_eos(arch: str) -> None:
    """A text ending in eos (pad == eos): headkit pools that eos, because padding comes from
    the attention mask. The peer reads padding from ids and pools the token before it."""
    eos = 2
    peer = _peer(arch, pad=eos, eos=eos)
    model = _headed(peer)
    seqs = _random_seqs([5, 3], seed=4)
    seqs[0].append(eos)
    ids, mask = _padded(seqs, "right", eos)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).preds_by_head["cls"]
        hidden = peer.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        want = peer.score(hidden[torch.arange(2), torch.tensor([5, 2])])
        theirs = peer(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], theirs[1], atol=1e-5, rtol=1e-5)
    # Row 0 differs: the peer skips the trailing eos it cannot tell from padding.
    torch.testing.assert_close(theirs[0], peer.score(hidden[0, 4]), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- sentence-transformers
def test_mean_pooling_equals_sentence_transformers_minilm(minilm, minilm_st) -> None:
    texts = [
        "A gripping, beautifully shot film.",
        "Dull.",
        "The plot meanders for two hours and the jokes land with a thud, but the lead "
        "performance is remarkable enough to keep you watching until the very end.",
        "Not bad, honestly.",
    ]
    st = minilm_st.eval()
    assert [type(m).__name__ for m in st] == ["Transformer", "Pooling", "Normalize"]
    features = st.preprocess(texts)
    with torch.no_grad():
        # Transformer then Pooling, i.e. the sentence embedding before Normalize.
        want = st[1](st[0](dict(features)))["sentence_embedding"]
        normalised = st.encode(texts, convert_to_tensor=True)

    hidden = st[0].get_embedding_dimension()
    head = HeadConfig(
        name="emb", pred_for_sequence=True, pooling="mean", num_outputs=hidden, loss_fct=None
    )
    model = HeadedModel(minilm[0], [head]).eval()
    with torch.no_grad():
        model.heads["emb"].linears[0].weight.copy_(torch.eye(hidden))  # identity: preds = pooled
        got = model(
            input_ids=features["input_ids"],
            attention_mask=features["attention_mask"],
            token_type_ids=features["token_type_ids"],
        ).preds_by_head["emb"]
    assert features["attention_mask"].sum(1).unique().numel() == len(texts)  # real padding
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        torch.nn.functional.normalize(got, dim=-1), normalised, atol=1e-5, rtol=1e-5
    )


ST_MODES = {
    "cls": "first",
    "lasttoken": "last",
    "mean": "mean",
    "max": "max",
    "mean_sqrt_len_tokens": "mean_sqrt_len",
    "weightedmean": "weighted_mean",
}


@pytest.mark.parametrize("side", ["right", "left"])
def test_every_sentence_transformers_pooling_mode_matches(side: str) -> None:
    from sentence_transformers.sentence_transformer.modules import Pooling

    from headkit import SequencePooling

    hidden = 8
    _, mask = _padded(_random_seqs([5, 1, 3, 4], seed=5), side, PAD)
    states = torch.randn(*mask.shape, hidden, generator=torch.Generator().manual_seed(6))
    theirs = Pooling(hidden, pooling_mode=tuple(ST_MODES))
    ours = SequencePooling(list(ST_MODES.values()), hidden)
    with torch.no_grad():
        features = {"token_embeddings": states, "attention_mask": mask}
        want = theirs(features)["sentence_embedding"]
        got = ours(states, mask)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
