"""Generation with heads: ``HeadedModel.generate`` against the backbone's own ``generate`` and
against a plain forward over the generated sequences (tiny GPT-2 and Llama).

Prompts of different lengths share one left-padded batch throughout. The convention under test:
a token head's output for generated token t is its value at the position of token t in a plain
forward over the final sequences; a sequence head pools each finished sequence (up to eos).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import PAD, build_tiny
from transformers import DynamicCache, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from headkit import BatchError, ConfigError, HeadConfig, HeadedGenerateOutput, HeadedModel

pytestmark = pytest.mark.usefixtures("single_thread")

DECODERS = ("gpt2", "llama")
NEW = 10  # max_new_tokens


def headed(
    arch: str, *extra: HeadConfig, sentiment_layer: int = -1
) -> tuple[HeadedModel, torch.nn.Module]:
    """(HeadedModel with an LM head, a value head on layer 1 and a mean-pooled sequence head,
    the 3-block HF *ForCausalLM it was built from)."""
    hf = build_tiny(arch)
    heads = [
        HeadConfig("lm_head", is_causal_lm=True),
        HeadConfig("value", layer_hook=1, num_outputs=1, is_regression=True, loss_fct="mse"),
        HeadConfig(
            "sentiment",
            layer_hook=sentiment_layer,
            num_outputs=2,
            pred_for_sequence=True,
            pooling="mean",
        ),
        *extra,
    ]
    return HeadedModel(hf, heads).eval(), hf


def prompts() -> dict[str, torch.Tensor]:
    """Three prompts of lengths 7, 5 and 2, left-padded with the pad id."""
    ids = torch.randint(3, 100, (3, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :5] = 0
    return {"input_ids": ids.masked_fill(mask == 0, PAD), "attention_mask": mask}


def assert_matches_a_plain_forward(model: HeadedModel, out: HeadedGenerateOutput, P: int) -> None:
    """Every per-step value equals a plain forward over the final sequences at its position."""
    plain = model(input_ids=out.sequences, attention_mask=out.attention_mask)
    real = out.generated_mask.bool()  # (rows, N): generated tokens up to and including eos
    value = plain.preds_by_head["value"][:, P:]
    torch.testing.assert_close(out.head_outputs["value"][real], value[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(
        out.head_outputs["sentiment"], plain.preds_by_head["sentiment"], atol=1e-5, rtol=0
    )
    # log p(token t | prefix): the logits at t - 1, read at token t
    logp = torch.log_softmax(plain.preds_by_head["lm_head"][:, P - 1 : -1].float(), -1)
    chosen = logp.gather(-1, out.sequences[:, P:, None]).squeeze(-1)
    torch.testing.assert_close(out.token_logprobs[real], chosen[real], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- against the backbone
@pytest.mark.parametrize("arch", DECODERS)
def test_greedy_gives_exactly_the_backbones_tokens(arch):
    model, hf = headed(arch)
    batch = prompts()
    expected = hf.generate(**batch, max_new_tokens=NEW, do_sample=False)
    out = model.generate(**batch, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out.sequences, expected)
    assert out.sequences.shape == (3, 7 + NEW)
    assert out.head_outputs["value"].shape == (3, NEW, 1)
    assert out.head_outputs["sentiment"].shape == (3, 2)
    assert out.token_logprobs.shape == (3, NEW) and bool((out.token_logprobs <= 0).all())


def test_a_generation_config_works_as_in_the_backbones_generate():
    model, hf = headed("llama")
    config = GenerationConfig(max_new_tokens=5, do_sample=True, top_k=5, num_return_sequences=2)
    torch.manual_seed(3)
    expected = hf.generate(**prompts(), generation_config=config)
    torch.manual_seed(3)
    out = model.generate(**prompts(), generation_config=config)
    assert torch.equal(out.sequences, expected) and out.sequences.shape == (6, 12)
    assert not config.return_dict_in_generate  # the caller's config is left as it was


SAMPLING = {
    "temperature-top-k": dict(do_sample=True, temperature=0.7, top_k=20),
    "top-p": dict(do_sample=True, top_p=0.8),
    "repetition-penalty": dict(do_sample=False, repetition_penalty=1.5),
    "num-return-sequences": dict(do_sample=True, num_return_sequences=3, temperature=1.3),
}


@pytest.mark.parametrize("settings", SAMPLING.values(), ids=SAMPLING.keys())
@pytest.mark.parametrize("arch", DECODERS)
def test_seeded_sampling_gives_the_backbones_samples(arch, settings):
    model, hf = headed(arch)
    batch = prompts()
    torch.manual_seed(7)
    expected = hf.generate(
        **batch, max_new_tokens=NEW, output_scores=True, return_dict_in_generate=True, **settings
    )
    torch.manual_seed(7)
    out = model.generate(**batch, max_new_tokens=NEW, output_scores=True, **settings)
    assert torch.equal(out.sequences, expected.sequences)
    rows = 3 * settings.get("num_return_sequences", 1)
    assert out.sequences.shape == (rows, 7 + NEW)
    assert len(out.scores) == NEW  # the processed scores, as transformers returns them
    for ours, theirs in zip(out.scores, expected.scores):
        # bit-identical for a head sharing the LM head's weight (test_tying.py); this trainable
        # copy may differ in the last bit (matmul picks its kernel by requires_grad)
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert_matches_a_plain_forward(model, out, P=7)


# ---------------------------------------------------------------------- against a plain forward
@pytest.mark.parametrize("arch", DECODERS)
def test_head_outputs_at_each_step_equal_a_plain_forward_over_the_final_sequences(arch):
    model, _ = headed(
        arch, HeadConfig("last_value", num_outputs=1, pred_for_sequence=True, pooling="last")
    )
    out = model.generate(**prompts(), max_new_tokens=NEW, do_sample=False)
    assert_matches_a_plain_forward(model, out, P=7)
    # the "last"-pooled sequence head reads the final position of each finished sequence
    last_value = model(input_ids=out.sequences, attention_mask=out.attention_mask)
    torch.testing.assert_close(
        out.head_outputs["last_value"], last_value.preds_by_head["last_value"], atol=1e-5, rtol=0
    )


def _eos_for_the_first_row(tokens: torch.Tensor) -> tuple[int, int]:
    """A token the first row generates early and the others never do, and its first index."""
    for i, t in enumerate(tokens[0, :-2].tolist()):
        if t != PAD and not (tokens[1:] == t).any() and t not in tokens[0, :i].tolist():
            return t, i
    raise AssertionError(f"no token ends only the first row in {tokens}")


@pytest.mark.parametrize("arch", DECODERS)
def test_eos_stops_each_row_on_its_own(arch):
    model, hf = headed(arch)
    batch = prompts()
    free = model.generate(**batch, max_new_tokens=NEW, do_sample=False)
    eos, at = _eos_for_the_first_row(free.sequences[:, 7:])
    expected = hf.generate(**batch, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    # several eos ids work as in transformers; 99 is never generated here
    out = model.generate(**batch, max_new_tokens=NEW, do_sample=False, eos_token_id=[99, eos])
    assert torch.equal(out.sequences, expected)
    generated = out.sequences[:, 7:]
    assert generated[0, at] == eos and bool((generated[0, at + 1 :] == PAD).all())
    assert out.generated_mask[0].tolist() == [1] * (at + 1) + [0] * (NEW - at - 1)
    assert bool(out.generated_mask[1:].all())  # the other rows ran to max_new_tokens
    assert torch.equal(generated[1:], free.sequences[1:, 7:])
    assert_matches_a_plain_forward(model, out, P=7)  # the sequence head pooled up to eos


def test_max_new_tokens_bounds_the_generated_length():
    model, hf = headed("gpt2")
    out = model.generate(**prompts(), max_new_tokens=3)
    assert out.sequences.shape == (3, 10) and out.token_logprobs.shape == (3, 3)
    assert out.head_outputs["value"].shape == (3, 3, 1)
    assert torch.equal(out.sequences, hf.generate(**prompts(), max_new_tokens=3))


def test_prompts_without_a_mask_count_every_token():
    model, hf = headed("gpt2")
    ids = prompts()["input_ids"][:1]  # one unpadded prompt
    out = model.generate(ids, max_new_tokens=5, ignore_heads="sentiment")  # a name, or names
    assert torch.equal(out.sequences, hf.generate(ids, max_new_tokens=5))
    assert set(out.head_outputs) == {"value"} and bool(out.attention_mask.all())


class Collect(BaseStreamer):
    """A streamer that keeps what generate pushes: the prompts, then one token per row."""

    def __init__(self) -> None:
        self.pushed: list[torch.Tensor] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.pushed.append(value.clone())

    def end(self) -> None:
        self.ended = True


def test_a_streamer_receives_every_generated_token():
    model, _ = headed("llama")
    batch = prompts()
    streamer = Collect()
    out = model.generate(**batch, max_new_tokens=NEW, streamer=streamer)
    assert streamer.ended and torch.equal(streamer.pushed[0], batch["input_ids"])
    assert torch.equal(torch.stack(streamer.pushed[1:], -1), out.sequences[:, 7:])


# ---------------------------------------------------------------------- one pass, as deep as needed
def _count_calls(module: torch.nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_heads_read_the_same_forward_as_the_tokens_and_the_extra_step_stops_early():
    model, hf = headed("gpt2", sentiment_layer=1)  # both heads read layer 1 of 3
    first, last = _count_calls(model.backbone.h[0]), _count_calls(model.backbone.h[-1])
    hf.generate(**prompts(), max_new_tokens=NEW, do_sample=False)  # the same backbone object
    assert first[0] == last[0] == NEW
    first[0] = last[0] = 0
    model.generate(**prompts(), max_new_tokens=NEW, do_sample=False)
    # the last block runs once per generated token, as in the backbone's own generate: the heads
    # ran on the states of those same forwards; the extra step over the last token (for its head
    # outputs) stopped after block 1, the deepest block a head reads
    assert last[0] == NEW
    assert first[0] == NEW + 1


def test_ignored_heads_are_not_computed():
    model, _ = headed("gpt2")
    value_calls, last = _count_calls(model.heads["value"]), _count_calls(model.backbone.h[-1])
    out = model.generate(**prompts(), max_new_tokens=NEW, ignore_heads=["value", "sentiment"])
    assert out.head_outputs == {} and value_calls[0] == 0
    assert last[0] == NEW  # no extra step: nothing needs the last token's states
    with_heads = model.generate(**prompts(), max_new_tokens=NEW)
    assert torch.equal(out.sequences, with_heads.sequences)
    torch.testing.assert_close(out.token_logprobs, with_heads.token_logprobs, atol=0, rtol=0)
    only_value = model.generate(**prompts(), max_new_tokens=NEW, ignore_heads=["sentiment"])
    assert set(only_value.head_outputs) == {"value"}


def test_an_lm_head_on_an_earlier_layer_runs_only_that_deep():
    hf = build_tiny("llama")
    model = HeadedModel(hf, [HeadConfig("lm_head", is_causal_lm=True, layer_hook=2)]).eval()
    last = _count_calls(model.backbone.layers[-1])
    batch = prompts()
    out = model.generate(**batch, max_new_tokens=6, do_sample=False)
    assert last[0] == 0  # block 3 of 3 never runs: the LM head reads layer 2
    ids, mask = batch["input_ids"], batch["attention_mask"]
    for _ in range(6):  # greedy with plain forwards, no cache
        logits = model(input_ids=ids, attention_mask=mask).preds_by_head["lm_head"][:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], -1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], -1)
    assert torch.equal(out.sequences, ids)


def test_generate_leaves_the_models_mode_as_it_was():
    model, _ = headed("gpt2")
    model.train()
    model.generate(**prompts(), max_new_tokens=2)
    assert model.training and model.heads.training


# ---------------------------------------------------------------------- errors
def _bert_model():
    with warnings.catch_warnings():  # a causal-LM head on a bidirectional backbone
        warnings.simplefilter("ignore")
        return HeadedModel(build_tiny("bert"), [HeadConfig("lm_head", is_causal_lm=True)])


def _two_lm_heads() -> HeadedModel:
    """An LM head on the last layer and one on layer 2 (e.g. for early-exit drafting)."""
    heads = [
        HeadConfig("lm", is_causal_lm=True),
        HeadConfig("lm_k2", is_causal_lm=True, layer_hook=2),
    ]
    return HeadedModel(build_tiny("llama"), heads).eval()


def test_lm_head_name_chooses_among_causal_lm_heads():
    model = _two_lm_heads()
    out = model.generate(**prompts(), max_new_tokens=4, lm_head_name="lm_k2")
    assert out.head_outputs["lm"].shape == (3, 4, 100)  # the other LM head is a token head
    plain = model(input_ids=out.sequences, attention_mask=out.attention_mask).preds_by_head
    torch.testing.assert_close(
        plain["lm_k2"][:, 6:-1].argmax(-1), out.sequences[:, 7:]
    )  # greedy over lm_k2's logits


def _right_padded():
    batch = prompts()
    return {k: v.flip(-1) for k, v in batch.items()}


GENERATION_CASES = {
    "no-causal-lm-head": (
        lambda: HeadedModel(build_tiny("gpt2"), [HeadConfig("v")]).generate(**prompts()),
        ConfigError,
        r"generate needs a causal-LM head to choose tokens with, but the model has none "
        r"\(heads: \['v'\]\)",
    ),
    "encoder-backbone": (
        lambda: _bert_model().generate(**prompts()),
        ConfigError,
        r"generate needs a decoder-only backbone; BertModel is bidirectional",
    ),
    "right-padded-prompts": (
        lambda: headed("gpt2")[0].generate(**_right_padded()),
        BatchError,
        r"attention_mask rows \[1, 2\] have padding after their tokens \(right padding\).*"
        r"padding_side = 'left'",
    ),
    "all-padding-prompt": (
        lambda: headed("gpt2")[0].generate(
            prompts()["input_ids"], attention_mask=torch.zeros(3, 7, dtype=torch.long)
        ),
        BatchError,
        r"attention_mask rows \[0, 1, 2\] are all padding",
    ),
    "beam-search": (
        lambda: headed("gpt2")[0].generate(**prompts(), num_beams=2),
        ConfigError,
        r"supports greedy search and sampling.*got beam_search",
    ),
    "no-kv-cache": (
        lambda: headed("gpt2")[0].generate(**prompts(), use_cache=False),
        ConfigError,
        r"needs the KV cache; use_cache=False is invalid",
    ),
    "ignore-unknown-head": (
        lambda: headed("gpt2")[0].generate(**prompts(), ignore_heads=["valeu"]),
        ConfigError,
        r"ignore_heads=\['valeu'\] names no head of the model; heads: \['lm_head', 'sentiment'",
    ),
    "ignore-the-lm-head": (
        lambda: headed("gpt2")[0].generate(**prompts(), ignore_heads=["lm_head"]),
        ConfigError,
        r"ignore_heads names 'lm_head', the causal-LM head generate chooses tokens with",
    ),
    "several-causal-lm-heads": (
        lambda: _two_lm_heads().generate(**prompts()),
        ConfigError,
        r"the model has several causal-LM heads \['lm', 'lm_k2'\]; pass lm_head_name= to choose",
    ),
    "lm-head-name-not-causal": (
        lambda: headed("gpt2")[0].generate(**prompts(), lm_head_name="value"),
        ConfigError,
        r"lm_head_name='value' is not a causal-LM head of the model; "
        r"causal-LM heads: \['lm_head'\]",
    ),
    "lm-head-not-over-the-vocabulary": (
        lambda: HeadedModel(
            build_tiny("gpt2"), [HeadConfig("lm_head", is_causal_lm=True, num_outputs=50)]
        ).generate(**prompts()),
        ConfigError,
        r"HeadConfig\(name='lm_head'\): num_outputs=50 is not the vocabulary size \(100\)",
    ),
    "cache-handed-in": (
        lambda: headed("gpt2")[0].generate(**prompts(), past_key_values=DynamicCache()),
        ConfigError,
        r"generate with heads builds its own KV cache; past_key_values= is not supported",
    ),
    "inputs-embeds": (
        lambda: headed("gpt2")[0].generate(**prompts(), inputs_embeds=torch.zeros(3, 7, 32)),
        BatchError,
        r"generate takes input_ids; inputs_embeds is not supported here",
    ),
    "token-id-outside-vocab": (
        lambda: headed("gpt2")[0].generate(torch.tensor([[5, 100]])),
        BatchError,
        r"input_ids holds token id 100, outside the vocabulary; allowed: 0..99",
    ),
    "num-return-sequences-beyond-the-cap": (
        lambda: headed("llama")[0].generate(
            **prompts(), do_sample=True, num_return_sequences=10**6
        ),
        ConfigError,
        r"num_return_sequences=1000000 is invalid; 1 to 10000 sequences per prompt",
    ),
    "generation-beyond-free-memory": (
        lambda: headed("gpt2")[0].generate(**prompts(), max_new_tokens=10**12),
        ConfigError,
        r"generate with batch 3 × num_return_sequences 1 = 3 rows of 7 \+ 1000000000000 "
        r"positions needs at least \d+\.\d GiB \(KV cache and logits\), but the cpu device "
        r"has \d+\.\d GiB free",
    ),
}


@pytest.mark.parametrize("make,error,pattern", GENERATION_CASES.values(), ids=GENERATION_CASES)
def test_generate_error(make, error, pattern):
    with pytest.raises(error, match=pattern) as info:
        make()
    assert type(info.value) is error and isinstance(info.value, ValueError)


# ---------------------------------------------------------------------- the cached forward
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("arch", DECODERS)
def test_incremental_decoding_of_a_left_padded_batch_equals_a_full_forward(arch, chunk):
    """A cached forward takes the (batch, past + new) mask and derives positions from it."""
    model, _ = headed(arch)
    batch = prompts()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    full = model(**batch)
    out = model(input_ids=ids[:, :3], attention_mask=mask[:, :3], use_cache=True)
    pieces = [out.preds_by_head]
    for t in range(3, ids.shape[1], chunk):
        out = model(
            input_ids=ids[:, t : t + chunk],
            attention_mask=mask[:, : t + chunk],  # covers the cached positions and the new ones
            past_key_values=out.cache,
            use_cache=True,
        )
        pieces.append(out.preds_by_head)
    real = mask.bool()
    for name in ("lm_head", "value"):
        stepped = torch.cat([p[name] for p in pieces], 1)
        torch.testing.assert_close(stepped[real], full.preds_by_head[name][real], atol=1e-5, rtol=0)
    # the sequence head of the last step pools only the new positions it was given
    assert pieces[-1]["sentiment"].shape == (3, 2)


def test_a_cached_forward_refuses_a_mask_that_does_not_cover_past_and_new():
    model, _ = headed("gpt2")
    batch = prompts()
    out = model(**batch, use_cache=True)
    with pytest.raises(
        BatchError,
        match=r"attention_mask of shape \(3, 1\) does not match.*"
        r"with 7 cached positions: \(batch, past \+ new\)\); expected \(3, 8\)",
    ):
        model(
            input_ids=batch["input_ids"][:, -1:],
            attention_mask=batch["attention_mask"][:, -1:],
            past_key_values=out.cache,
            use_cache=True,
        )
