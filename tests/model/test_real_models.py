"""headkit on the real packaged models: all-MiniLM-L6-v2 (BERT encoder) and SmolLM2 (Llama GGUF)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headkit import HeadConfig, HeadedModel
from headkit.packaged import rotten_tomatoes, train_test_split

pytestmark = pytest.mark.usefixtures("single_thread")

SENTENCES = [
    "A gripping, beautifully acted drama.",
    "Dull.",
    "The plot wanders for two hours and never arrives anywhere worth the trip.",
    "Funny and warm.",
]


def identity_heads(model: HeadedModel, width: int) -> HeadedModel:
    """Give every head identity weights, so its predictions are the states it reads."""
    with torch.no_grad():
        for head in model.heads.values():
            head.linears[0].weight.copy_(torch.eye(width))
    return model.eval()


# ---------------------------------------------------------------------- MiniLM
def test_minilm_hooked_states_equal_output_hidden_states(minilm):
    hf, tokenizer = minilm
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    L, width = hf.config.num_hidden_layers, hf.config.hidden_size
    indices = list(range(L + 1)) + list(range(-1, -(L + 2), -1))
    configs = [
        HeadConfig(f"at_{i}".replace("-", "m"), layer_hook=i, num_outputs=width) for i in indices
    ]
    model = identity_heads(HeadedModel(hf, configs), width)
    with torch.no_grad():
        out = model(**batch)
        reference = hf(**batch, output_hidden_states=True).hidden_states
    assert len(reference) == L + 1 == 7
    for i, cfg in zip(indices, configs):
        torch.testing.assert_close(
            out.preds_by_head[cfg.name], reference[i], atol=1e-5, rtol=0, msg=f"layer_hook={i}"
        )


def test_minilm_mean_pooling_equals_masked_mean_of_last_hidden_state(minilm):
    hf, tokenizer = minilm
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    assert batch["attention_mask"].sum() < batch["attention_mask"].numel()  # padding present
    config = HeadConfig("embedding", num_outputs=384, pred_for_sequence=True, pooling="mean")
    model = identity_heads(HeadedModel(hf, [config]), 384)
    with torch.no_grad():
        pooled = model(**batch).preds_by_head["embedding"]
        last = hf(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    expected = (last * mask).sum(1) / mask.sum(1)
    assert pooled.shape == (len(SENTENCES), 384)
    torch.testing.assert_close(pooled, expected, atol=1e-5, rtol=0)


def test_minilm_sentiment_probe_learns_from_rotten_tomatoes(minilm):
    """Train a mean-pooled linear probe on 200 real reviews: the training loss falls, and the
    held-out loss ends below that of always predicting the training class frequencies."""
    hf, tokenizer = minilm
    train, test = train_test_split(rotten_tomatoes(limit=200, seed=0), test_fraction=0.2)
    config = HeadConfig("sentiment", num_outputs=2, pred_for_sequence=True, pooling="mean")
    torch.manual_seed(0)
    model = HeadedModel(hf, [config])
    head = model.heads["sentiment"]

    def encode(rows):
        batch = tokenizer(
            [t for t, _ in rows], padding=True, truncation=True, max_length=48, return_tensors="pt"
        )
        return batch, torch.tensor([y for _, y in rows])

    # The backbone is frozen: pool each review once, then train the head on the features.
    def pooled_features(rows):
        batch, labels = encode(rows)
        with torch.no_grad():
            states = model(**batch, output_hidden_states=True).hidden_states[-1]
            return head.features(states, batch["attention_mask"]), labels

    x_train, y_train = pooled_features(train)
    x_test, y_test = pooled_features(test)
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)

    def loss_on(x, y):
        return F.cross_entropy(head.from_features(x), y)

    with torch.no_grad():
        start_train, start_test = loss_on(x_train, y_train).item(), loss_on(x_test, y_test).item()
    for _ in range(60):
        loss = loss_on(x_train, y_train)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        end_train, end_test = loss_on(x_train, y_train).item(), loss_on(x_test, y_test).item()
    fresh = y_train.float().mean()
    prior = F.cross_entropy(
        torch.log(torch.stack([1 - fresh, fresh])).expand(len(y_test), 2), y_test
    )
    assert end_train < 0.7 * start_train, (start_train, end_train)
    assert end_test < start_test and end_test < prior.item(), (start_test, end_test, prior)

    # the trained head inside the model gives the same loss through a full forward
    batch, labels = encode(test[:8])
    with torch.no_grad():
        out = model(**batch, sentiment=labels)
        expected = loss_on(x_test[:8], y_test[:8])
    torch.testing.assert_close(out.loss, expected, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------- SmolLM2
@pytest.mark.slow
def test_smollm2_lm_head_and_layer_2_probe_match_the_model(smollm2):
    width = smollm2.config.hidden_size
    ids = torch.tensor([[1, 504, 3458, 282, 3276, 314, 2]])  # fixed ids: no GGUF tokenizer parse
    configs = [
        HeadConfig("lm_head", is_causal_lm=True),
        HeadConfig("probe", layer_hook=2, num_outputs=width),
    ]
    model = HeadedModel(smollm2, configs).eval()
    with torch.no_grad():
        model.heads["probe"].linears[0].weight.copy_(torch.eye(width))
        out = model(input_ids=ids)
        reference = smollm2(input_ids=ids, output_hidden_states=True)
    assert out.preds_by_head["lm_head"].shape == (1, 7, smollm2.config.vocab_size)
    torch.testing.assert_close(out.preds_by_head["lm_head"], reference.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.preds_by_head["probe"], reference.hidden_states[2])

    # alone, the layer-2 probe runs 2 of the 30 blocks
    probe_only = HeadedModel(smollm2, configs[1:]).eval()
    runs = [0] * len(smollm2.model.layers)
    handles = [
        block.register_forward_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
        for i, block in enumerate(smollm2.model.layers)
    ]
    try:
        with torch.no_grad():
            probe_only(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    assert runs == [1, 1] + [0] * 28


@pytest.mark.slow
def test_smollm2_generates_its_own_tokens_through_a_shared_lm_head(smollm2):
    """Greedy generation with a value head equals SmolLM2's own generate, scores bit for bit:
    the frozen lm_head is SmolLM2's tied embedding matrix itself, not a copy."""
    configs = [
        HeadConfig("lm_head", is_causal_lm=True, trainable=False),
        HeadConfig("value", num_outputs=1, is_regression=True, loss_fct="mse"),
    ]
    model = HeadedModel(smollm2, configs).eval()
    assert model.heads["lm_head"].linears[0].weight is smollm2.get_input_embeddings().weight
    ids = torch.tensor([[2, 2, 504, 3458, 282], [1, 504, 3458, 282, 3276]])  # row 0 left-padded
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    settings = dict(max_new_tokens=6, do_sample=False, output_scores=True)
    expected = smollm2.generate(ids, attention_mask=mask, return_dict_in_generate=True, **settings)
    out = model.generate(ids, attention_mask=mask, **settings)
    assert torch.equal(out.sequences, expected.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, expected.scores))
    plain = model(input_ids=out.sequences, attention_mask=out.attention_mask)
    real = out.generated_mask.bool()
    torch.testing.assert_close(
        out.head_outputs["value"][real],
        plain.preds_by_head["value"][:, 5:][real],
        atol=1e-4,
        rtol=0,
    )
