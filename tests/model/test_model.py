"""HeadedModel on tiny GPT-2, Llama and BERT, checked against the Hugging Face models themselves."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from conftest import HIDDEN, PAD, blocks_of, build_tiny

from headkit import BatchError, ConfigError, HeadConfig, HeadedModel
from headkit.backbone.inspection import StateKey, run_backbone

pytestmark = pytest.mark.usefixtures("single_thread")

DECODERS = ("gpt2", "llama")


def identity_probe(name: str, layer_hook: int, **kwargs) -> HeadConfig:
    """A token head that will be given identity weights, so its predictions are the states."""
    return HeadConfig(name, layer_hook=layer_hook, num_outputs=HIDDEN, **kwargs)


def set_identity(model: HeadedModel) -> HeadedModel:
    with torch.no_grad():
        for head in model.heads.values():
            head.linears[0].weight.copy_(torch.eye(HIDDEN))
    return model


@contextmanager
def count_block_runs(model) -> Iterator[list[int]]:
    """Count how often each transformer block of ``model`` completes a forward."""
    blocks = blocks_of(model)
    counts = [0] * len(blocks)

    def make(i: int):
        def hook(*_):
            counts[i] += 1

        return hook

    handles = [b.register_forward_hook(make(i)) for i, b in enumerate(blocks)]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


# ---------------------------------------------------------------------- causal-LM head
@pytest.mark.parametrize("arch", DECODERS)
def test_lm_head_equals_the_hf_causal_lm(arch, token_batch):
    hf = build_tiny(arch)
    model = HeadedModel(hf, [HeadConfig("lm_head", is_causal_lm=True)]).eval()
    ids = token_batch["input_ids"]
    out = model(**token_batch, lm_head=ids)
    ref = hf(**token_batch, labels=ids)  # HF shifts the labels internally
    assert out.preds_by_head["lm_head"].shape == (3, 8, hf.config.vocab_size)
    torch.testing.assert_close(out.preds_by_head["lm_head"], ref.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.loss_by_head["lm_head"], ref.loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- layer indexing
@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_every_layer_index_equals_output_hidden_states(arch, token_batch):
    hf = build_tiny(arch)
    L = hf.config.num_hidden_layers
    indices = list(range(L + 1)) + list(range(-1, -(L + 2), -1))
    configs = [identity_probe(f"at_{i}".replace("-", "m"), i) for i in indices]
    model = set_identity(HeadedModel(hf, configs).eval())
    out = model(**token_batch)
    reference = hf(**token_batch, output_hidden_states=True).hidden_states
    assert len(reference) == L + 1
    for i, cfg in zip(indices, configs):
        torch.testing.assert_close(
            out.preds_by_head[cfg.name], reference[i], atol=1e-5, rtol=0, msg=f"layer_hook={i}"
        )


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_run_backbone_captures_each_index_with_early_exit(arch, token_batch):
    hf = build_tiny(arch)
    model = HeadedModel(hf, [HeadConfig("unused")])
    reference = model.backbone(**token_batch, output_hidden_states=True).hidden_states
    L = model.info.num_layers
    for i in range(L + 1):
        key = StateKey("encoder", i)
        captured, _ = run_backbone(model.backbone, model.info, {key}, True, dict(token_batch))
        torch.testing.assert_close(captured[key], reference[i], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- early exit
@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_early_exit_runs_only_the_blocks_a_probe_needs(arch, token_batch):
    hf = build_tiny(arch, num_layers=4)
    configs = [
        HeadConfig("probe", layer_hook=2, num_outputs=3),
        HeadConfig("pooled", layer_hook=1, num_outputs=2, pred_for_sequence=True),
    ]
    fast = HeadedModel(hf, configs).eval()
    with count_block_runs(hf) as runs:
        early = fast(**token_batch)
    assert runs == [1, 1, 0, 0]  # blocks 0 and 1 produce hidden_states[2]; 2 and 3 never run

    full = HeadedModel(hf, configs, early_exit=False).eval()
    full.load_state_dict(fast.state_dict())
    with count_block_runs(hf) as runs:
        late = full(**token_batch)
    assert runs == [1, 1, 1, 1]
    for name in ("probe", "pooled"):
        assert torch.equal(early.preds_by_head[name], late.preds_by_head[name])

    embeddings_only = HeadedModel(hf, [HeadConfig("emb", layer_hook=0)]).eval()
    with count_block_runs(hf) as runs:
        embeddings_only(**token_batch)
    assert runs == [0, 0, 0, 0]


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_a_last_layer_head_runs_every_block(arch, token_batch):
    hf = build_tiny(arch, num_layers=4)
    model = HeadedModel(hf, [HeadConfig("top", layer_hook=-1)]).eval()
    with count_block_runs(hf) as runs:
        model(**token_batch)
    assert runs == [1, 1, 1, 1]


@pytest.mark.parametrize("arch", DECODERS)
def test_use_cache_and_output_hidden_states_run_everything(arch, token_batch):
    hf = build_tiny(arch, num_layers=4)
    model = set_identity(HeadedModel(hf, [identity_probe("probe", 2)]).eval())
    early = model(**token_batch).preds_by_head["probe"]

    with count_block_runs(hf) as runs:
        out = model(**token_batch, use_cache=True)
    assert runs == [1, 1, 1, 1]
    assert out.cache is not None and out.past_key_values is out.cache
    assert out.cache.get_seq_length() == token_batch["input_ids"].shape[1]
    assert torch.equal(out.preds_by_head["probe"], early)

    with count_block_runs(hf) as runs:
        out = model(**token_batch, output_hidden_states=True)
    assert runs == [1, 1, 1, 1]
    reference = hf(**token_batch, output_hidden_states=True).hidden_states
    assert out.hidden_states is not None and len(out.hidden_states) == 5
    for mine, theirs in zip(out.hidden_states, reference):
        torch.testing.assert_close(mine, theirs)
    torch.testing.assert_close(out.preds_by_head["probe"], reference[2])


@pytest.mark.parametrize("arch", DECODERS)
def test_a_cache_continues_the_sequence(arch, token_batch):
    hf = build_tiny(arch)
    model = set_identity(HeadedModel(hf, [identity_probe("top", -1)]).eval())
    ids = token_batch["input_ids"]
    whole = model(input_ids=ids).preds_by_head["top"]
    prefix = model(input_ids=ids[:, :5], use_cache=True)
    rest = model(input_ids=ids[:, 5:], past_key_values=prefix.cache, use_cache=True)
    torch.testing.assert_close(rest.preds_by_head["top"], whole[:, 5:], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- padding
def _sequence_model(hf, pooling: str | None = None) -> HeadedModel:
    configs = [identity_probe("pooled", -1, pred_for_sequence=True, pooling=pooling)]
    return set_identity(HeadedModel(hf, configs).eval())


@pytest.mark.parametrize("arch", DECODERS)
def test_pad_equal_to_eos_and_left_padding_give_unpadded_predictions(arch):
    hf = build_tiny(arch)
    model = _sequence_model(hf)  # decoders pool the last real token by default
    assert model.head_configs["pooled"].pooling == "last"
    row = torch.tensor([[5, 6, 7, PAD]])  # ends in a real eos, which is also the pad id
    alone = model(input_ids=row).preds_by_head["pooled"][0]

    right = torch.tensor([[5, 6, 7, PAD, PAD, PAD], [9, 10, 11, 12, 13, 14]])
    right_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    left = torch.tensor([[PAD, PAD, 5, 6, 7, PAD], [9, 10, 11, 12, 13, 14]])
    left_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    for ids, mask in ((right, right_mask), (left, left_mask)):
        pooled = model(input_ids=ids, attention_mask=mask).preds_by_head["pooled"]
        torch.testing.assert_close(pooled[0], alone, atol=1e-5, rtol=0)


def test_gpt2_left_padding_needs_position_ids_from_the_mask():
    """Why headkit derives position_ids: plain GPT-2 shifts positions under left padding."""
    hf = build_tiny("gpt2")
    alone = hf.transformer(input_ids=torch.tensor([[5, 6, 7]])).last_hidden_state[0, -1]
    left = torch.tensor([[PAD, PAD, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    plain = hf.transformer(input_ids=left, attention_mask=mask).last_hidden_state[0, -1]
    assert not torch.allclose(plain, alone, atol=1e-3)
    pooled = _sequence_model(hf)(input_ids=left, attention_mask=mask).preds_by_head["pooled"]
    torch.testing.assert_close(pooled[0], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pooling", ["first", "mean", "max", "last"])
def test_bert_right_padding_gives_unpadded_sequence_predictions(pooling):
    model = _sequence_model(build_tiny("bert"), pooling)
    alone = model(input_ids=torch.tensor([[1, 5, 6, 7]])).preds_by_head["pooled"][0]
    ids = torch.tensor([[1, 5, 6, 7, 0, 0], [1, 9, 10, 11, 12, 13]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    pooled = model(input_ids=ids, attention_mask=mask).preds_by_head["pooled"]
    torch.testing.assert_close(pooled[0], alone, atol=1e-5, rtol=0)


def _padded_token_batch() -> dict[str, torch.Tensor]:
    ids = torch.tensor([[5, 6, 7, 8, PAD, PAD], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    return {"input_ids": ids, "attention_mask": mask}


def test_token_loss_ignores_padded_positions(tiny_gpt2):
    model = HeadedModel(tiny_gpt2, [HeadConfig("tag", num_outputs=3)]).eval()
    batch = _padded_token_batch()
    labels = batch["input_ids"] % 3
    out = model(**batch, tag=labels)
    changed = labels.clone()
    changed[0, 4:] = (changed[0, 4:] + 1) % 3  # only padded positions change
    assert torch.equal(model(**batch, tag=changed).loss, out.loss)

    logits = out.preds_by_head["tag"]
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(out.loss, F.cross_entropy(logits[real], labels[real]))
    # ignore_pads=False counts them
    counting = HeadedModel(tiny_gpt2, [HeadConfig("tag", num_outputs=3, ignore_pads=False)])
    counting.load_state_dict(model.state_dict())
    assert not torch.allclose(
        counting(**batch, tag=changed).loss, counting(**batch, tag=labels).loss
    )


def test_without_a_mask_every_token_counts(tiny_bert):
    model = HeadedModel(tiny_bert, [HeadConfig("tag", num_outputs=3)]).eval()
    ids = _padded_token_batch()["input_ids"]
    labels = ids % 3
    out = model(input_ids=ids, tag=labels)
    logits = out.preds_by_head["tag"]
    torch.testing.assert_close(out.loss, F.cross_entropy(logits.reshape(-1, 3), labels.reshape(-1)))


# ---------------------------------------------------------------------- losses
def _two_head_model(hf) -> HeadedModel:
    configs = [
        HeadConfig("tag", num_outputs=4, loss_weight=0.5),
        HeadConfig(
            "score", pred_for_sequence=True, is_regression=True, loss_fct="mse", loss_weight=2.0
        ),
    ]
    return HeadedModel(hf, configs).eval()


def test_loss_is_the_weighted_sum_of_head_losses(tiny_llama, token_batch):
    model = _two_head_model(tiny_llama)
    tags = token_batch["input_ids"] % 4
    scores = torch.tensor([0.1, -0.3, 2.0])
    out = model(**token_batch, tag=tags, score=scores)
    tag_loss = F.cross_entropy(out.preds_by_head["tag"].reshape(-1, 4), tags.reshape(-1))
    score_loss = F.mse_loss(out.preds_by_head["score"].squeeze(-1), scores)
    torch.testing.assert_close(out.loss_by_head["tag"], tag_loss)
    torch.testing.assert_close(out.loss_by_head["score"], score_loss)
    torch.testing.assert_close(out.adapted_loss_by_head["tag"], 0.5 * tag_loss)
    torch.testing.assert_close(out.adapted_loss_by_head["score"], 2.0 * score_loss)
    torch.testing.assert_close(out.loss, 0.5 * tag_loss + 2.0 * score_loss)


def test_a_head_without_its_label_gets_no_loss(tiny_llama, token_batch):
    model = _two_head_model(tiny_llama)
    tags = token_batch["input_ids"] % 4
    out = model(**token_batch, tag=tags)
    assert set(out.loss_by_head) == {"tag"} and set(out.preds_by_head) == {"tag", "score"}
    torch.testing.assert_close(out.loss, 0.5 * out.loss_by_head["tag"])
    none = model(**token_batch)
    assert none.loss is None and none.loss_by_head == {}


def test_minus_100_labels_are_ignored(tiny_bert, token_batch):
    configs = [
        HeadConfig("tag", num_outputs=4),
        HeadConfig("topic", num_outputs=5, pred_for_sequence=True),
    ]
    model = HeadedModel(tiny_bert, configs).eval()
    tags = token_batch["input_ids"] % 4
    tags[0, :3] = -100
    tags[2, 5] = -100
    topics = torch.tensor([1, -100, 4])
    out = model(**token_batch, tag=tags, topic=topics)
    keep = tags != -100
    tag_logits = out.preds_by_head["tag"]
    torch.testing.assert_close(
        out.loss_by_head["tag"], F.cross_entropy(tag_logits[keep], tags[keep])
    )
    topic_logits = out.preds_by_head["topic"]
    expected = F.cross_entropy(topic_logits[[0, 2]], topics[[0, 2]])
    torch.testing.assert_close(out.loss_by_head["topic"], expected)


# ---------------------------------------------------------------------- errors
def test_unknown_batch_key_is_a_batch_error(tiny_gpt2, token_batch):
    model = HeadedModel(tiny_gpt2, [HeadConfig("tag", num_outputs=2)])
    with pytest.raises(BatchError, match="'tga'") as err:
        model(**token_batch, tga=token_batch["input_ids"] % 2)
    assert "tag" in str(err.value)  # names the targets that exist


@pytest.mark.parametrize("target", ["attention_mask", "input_ids", "position_ids"])
def test_a_target_named_like_a_model_input_is_a_config_error(tiny_gpt2, target):
    with pytest.raises(ConfigError, match=f"target='{target}'"):
        HeadedModel(tiny_gpt2, [HeadConfig("h", target=target)])


def test_two_heads_with_one_name_is_a_config_error(tiny_gpt2):
    with pytest.raises(ConfigError, match="'twin'"):
        HeadedModel(tiny_gpt2, [HeadConfig("twin"), HeadConfig("twin", layer_hook=1)])


def test_in_size_mismatch_names_both_widths(tiny_gpt2):
    with pytest.raises(ConfigError, match=r"in_size=48.*\(32") as err:
        HeadedModel(tiny_gpt2, [HeadConfig("wide", in_size=48)])
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("layer_hook", [4, 9, -5])
def test_layer_hook_out_of_range_names_the_valid_range(tiny_gpt2, layer_hook):
    with pytest.raises(ConfigError, match=rf"layer_hook={layer_hook}\b.*-4\.\.3"):
        HeadedModel(tiny_gpt2, [HeadConfig("deep", layer_hook=layer_hook)])


# ---------------------------------------------------------------------- training
def test_a_probe_learns_a_toy_task_and_the_frozen_backbone_stays_unchanged(tiny_gpt2):
    """Token-level "is this token id even" from the last layer of a frozen GPT-2."""
    before = {k: v.clone() for k, v in tiny_gpt2.state_dict().items()}
    probe = HeadConfig("even", num_outputs=2, num_layers=2, hidden_size=64)
    model = HeadedModel(tiny_gpt2, [probe])
    ids = torch.randint(3, 100, (16, 12), generator=torch.Generator().manual_seed(3))
    labels = (ids % 2 == 0).long()
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.heads.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = model(input_ids=ids, even=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    after = tiny_gpt2.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in tiny_gpt2.parameters())
