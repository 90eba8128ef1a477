"""Heads on encoder–decoder models (T5, BART, Whisper): HeadConfig(stack="encoder"|"decoder"),
each stack's hidden states as HF numbers them, the encoder run alone for encoder heads, the
decoder as deep as needed, the model's LM head on the decoder, and generate."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import MEL_BINS, MEL_FRAMES, build_tiny
from tiny_media import assert_compiles_like_eager, assert_heads_match_hf, heads_at_every_layer
from transformers import GenerationMixin

from headkit import BatchError, ConfigError, HeadConfig, HeadedModel, cache_features, load_headed
from headkit.backbone.inspection import StateKey

pytestmark = pytest.mark.usefixtures("single_thread")

LAYERS = 2
#: The decoder-layer class of each architecture, to count the blocks that run.
BLOCKS = {
    "t5": ("T5Block", "T5Block"),
    "bart": ("BartEncoderLayer", "BartDecoderLayer"),
    "whisper": ("WhisperEncoderLayer", "WhisperDecoderLayer"),
}


def _batch(arch: str) -> dict[str, torch.Tensor]:
    """Encoder inputs with right padding, and decoder inputs with right padding."""
    g = torch.Generator().manual_seed(3)
    if arch == "whisper":
        encoder = {"input_features": torch.randn(2, MEL_BINS, MEL_FRAMES, generator=g)}
    else:
        ids = torch.randint(3, 100, (2, 6), generator=g)
        encoder = {"input_ids": ids, "attention_mask": torch.tensor([[1] * 6, [1] * 4 + [0] * 2])}
    decoder_ids = torch.randint(3, 100, (2, 4), generator=g)
    decoder_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    return {**encoder, "decoder_input_ids": decoder_ids, "decoder_attention_mask": decoder_mask}


def _heads(stack: str) -> list[HeadConfig]:
    return heads_at_every_layer(LAYERS, ("mean", "first", "last"), "tok", stack=stack)


class _Count:
    """Counts the calls of every module of one class while inside the ``with``."""

    def __init__(self, model, cls_name: str, part: str) -> None:
        owner = getattr(model, "get_encoder" if part == "encoder" else "get_decoder")()
        self.modules = [m for m in owner.modules() if type(m).__name__ == cls_name]
        self.calls = 0

    def __enter__(self) -> _Count:
        self.handles = [m.register_forward_hook(self._hook) for m in self.modules]
        return self

    def _hook(self, *_) -> None:
        self.calls += 1

    def __exit__(self, *_) -> None:
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("arch", ["t5", "bart", "whisper"])
def test_heads_on_each_stack_equal_hf_hidden_states(arch: str) -> None:
    backbone = build_tiny(arch, LAYERS)
    model = HeadedModel(backbone, _heads("encoder") + _heads("decoder"))
    batch = _batch(arch)
    out = model(**batch)
    hf = backbone(**batch, output_hidden_states=True)
    layers = model.hooked_layers()
    states, masks = {}, {}
    for name, cfg in model.head_configs.items():
        if cfg.stack == "encoder":
            states[name] = hf.encoder_hidden_states[layers[name]]
            masks[name] = batch.get("attention_mask")
        else:
            states[name] = hf.decoder_hidden_states[layers[name]]
            masks[name] = batch["decoder_attention_mask"]
    assert_heads_match_hf(model, out, states, masks)
    assert model.state_keys()["decoder_mean1"] == ("decoder", 1)
    # a named StateKey replaced the int | tuple union (issue 29 item 6): the encoder's state is
    # no longer a bare int
    assert model.state_keys()["encoder_mean1"] == StateKey("encoder", 1)
    assert model.state_keys()["decoder_mean1"].on_decoder


@pytest.mark.parametrize("arch", ["t5", "bart", "whisper"])
def test_encoder_heads_run_only_the_encoder_as_deep_as_needed(arch: str) -> None:
    backbone = build_tiny(arch, 3)
    encoder_block, decoder_block = BLOCKS[arch]
    batch = {k: v for k, v in _batch(arch).items() if not k.startswith("decoder_")}
    for layer, blocks in ((1, 1), (2, 2), (-1, 3)):
        model = HeadedModel(backbone, [HeadConfig("h", layer_hook=layer, pred_for_sequence=True)])
        with (
            _Count(backbone, encoder_block, "encoder") as enc,
            _Count(backbone, decoder_block, "decoder") as dec,
        ):
            model(**batch)  # no decoder inputs needed
        assert (enc.calls, dec.calls) == (blocks, 0), layer


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_decoder_heads_run_the_encoder_in_full_and_the_decoder_as_deep_as_needed(arch) -> None:
    backbone = build_tiny(arch, 3)
    encoder_block, decoder_block = BLOCKS[arch]
    head = HeadConfig("h", layer_hook=1, stack="decoder", pred_for_sequence=True)
    model = HeadedModel(backbone, [head])
    with (
        _Count(backbone, encoder_block, "encoder") as enc,
        _Count(backbone, decoder_block, "decoder") as dec,
    ):
        model(**_batch(arch))
    assert (enc.calls, dec.calls) == (3, 1)
    assert model.head_configs["h"].pooling == "last"  # the decoder is causal
    encoder_only = {k: v for k, v in _batch(arch).items() if not k.startswith("decoder_")}
    with pytest.raises(BatchError, match=r"stack='decoder'\) need decoder_input_ids"):
        model(**encoder_only)


def test_the_causal_lm_head_on_the_decoder_is_the_models_own() -> None:
    t5 = build_tiny("t5", LAYERS)  # T5ForConditionalGeneration scales states before its LM head
    bart = build_tiny("bart", LAYERS, task="seq2seq-lm")
    with torch.no_grad():
        bart.final_logits_bias.normal_()  # folded into the head's bias
    whisper = build_tiny("whisper", LAYERS, task="speech-seq2seq")
    for arch, hf in (("t5", t5), ("bart", bart), ("whisper", whisper)):
        lm = HeadConfig("lm_head", is_causal_lm=True, stack="decoder", output_bias=arch == "bart")
        model = HeadedModel(hf, [lm])
        batch = _batch(arch)
        torch.testing.assert_close(model(**batch).logits, hf(**batch).logits, msg=arch)
    with pytest.warns(UserWarning, match="final_logits_bias"):
        HeadedModel(bart, [HeadConfig("lm_head", is_causal_lm=True, stack="decoder")])


@pytest.mark.parametrize(
    ("arch", "task"), [("t5", None), ("bart", "seq2seq-lm"), ("whisper", "speech-seq2seq")]
)
def test_generate_with_decoder_heads_gives_the_models_tokens(arch: str, task) -> None:
    hf = build_tiny(arch, LAYERS, task=task)
    heads = [
        HeadConfig("lm_head", is_causal_lm=True, stack="decoder"),
        HeadConfig("value", layer_hook=1, num_outputs=2, stack="decoder"),
        HeadConfig("summary", num_outputs=3, pred_for_sequence=True, stack="decoder"),
    ]
    model = HeadedModel(hf, heads)
    batch = {k: v for k, v in _batch(arch).items() if not k.startswith("decoder_")}
    options = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False}
    out = model.generate(**batch, **options)
    # transformers' own generate loop on the model (Whisper's own pipeline adds its
    # language and timestamp logic on top of it)
    expected = GenerationMixin.generate(hf, **batch, **options)
    assert torch.equal(out.sequences, expected)
    plain = model(**batch, decoder_input_ids=out.sequences)
    torch.testing.assert_close(out.head_outputs["value"], plain.preds_by_head["value"][:, 1:])
    torch.testing.assert_close(out.head_outputs["summary"], plain.preds_by_head["summary"])
    logprobs = (
        plain.preds_by_head["lm_head"][:, :-1]
        .log_softmax(-1)
        .gather(-1, out.sequences[:, 1:, None])
    )
    torch.testing.assert_close(out.token_logprobs, logprobs[..., 0])


@pytest.mark.parametrize(
    ("arch", "task"), [("t5", None), ("bart", "seq2seq-lm"), ("whisper", "speech-seq2seq")]
)
def test_generate_returns_encoder_heads_once_per_sequence(arch: str, task) -> None:
    """Encoder heads beside decoder heads: the encoder runs once, its heads' outputs come
    back once per sequence (each prompt's for each of its returned sequences), equal to a
    plain forward's, and the tokens are the model's own."""
    hf = build_tiny(arch, LAYERS, task=task)
    heads = [
        HeadConfig("lm_head", is_causal_lm=True, stack="decoder"),
        HeadConfig("value", layer_hook=1, num_outputs=2, stack="decoder"),
        HeadConfig("topic", num_outputs=3, pred_for_sequence=True, pooling="mean"),
        HeadConfig("tags", layer_hook=1, num_outputs=4),  # a token head on the encoder
    ]
    model = HeadedModel(hf, heads)
    batch = {k: v for k, v in _batch(arch).items() if not k.startswith("decoder_")}
    options = {"max_new_tokens": 3, "min_new_tokens": 3, "do_sample": True}
    torch.manual_seed(0)
    with _Count(hf, BLOCKS[arch][0], "encoder") as encoder:
        out = model.generate(**batch, **options, num_return_sequences=2)
    assert encoder.calls == LAYERS  # every encoder block ran once, for both prompts together
    torch.manual_seed(0)
    expected = GenerationMixin.generate(hf, **batch, **options, num_return_sequences=2)
    assert torch.equal(out.sequences, expected)
    plain = model(**batch, decoder_input_ids=out.sequences[::2])
    for name in ("topic", "tags"):
        want = plain.preds_by_head[name].repeat_interleave(2, 0)
        torch.testing.assert_close(out.head_outputs[name], want, msg=name)
    assert out.head_outputs["topic"].shape == (4, 3)
    assert out.head_outputs["value"].shape == (4, 3, 2)
    only_decoder = model.generate(**batch, **options, ignore_heads=["topic", "tags"])
    assert set(only_decoder.head_outputs) == {"value"}
    on_encoder = [HeadConfig("lm_head", is_causal_lm=True), heads[1]]  # the encoder's stack
    with (
        pytest.warns(UserWarning, match="causal-LM head on a bidirectional"),
        pytest.raises(
            ConfigError,
            match=r"HeadConfig\(name='lm_head'\) reads the encoder \(stack='encoder'\), but "
            r"generate on an encoder–decoder model chooses tokens with a causal-LM head on its "
            r"decoder; give it stack='decoder', or pass lm_head_name= to choose a decoder head\.$",
        ),
    ):
        HeadedModel(hf, on_encoder).generate(**batch, **options)


def test_stack_is_ignored_by_models_with_one_stack_and_checked_everywhere() -> None:
    bert = build_tiny("bert", 2)
    ids = torch.tensor([[5, 6, 7]])
    heads = [
        HeadConfig("plain", num_outputs=2, layer_hook=1),
        HeadConfig("decoder", num_outputs=2, layer_hook=1, stack="decoder"),
    ]
    model = HeadedModel(bert, heads)
    with torch.no_grad():
        model.heads["decoder"].load_state_dict(model.heads["plain"].state_dict())
    out = model(input_ids=ids)
    assert torch.equal(out.preds_by_head["plain"], out.preds_by_head["decoder"])
    with pytest.raises(
        ConfigError, match=r"stack='middle' is invalid; allowed: 'encoder', 'decoder'"
    ):
        HeadConfig("h", stack="middle")
    assert "stack" not in HeadConfig("h").to_dict()  # the default is not written
    t5 = HeadedModel(build_tiny("t5", 2), [HeadConfig("h", target="labels")])  # its forward's
    assert t5.head_configs["h"].target == "labels"  # "labels" is no input: a target may be it
    assert HeadConfig.from_dict({"name": "h"}).stack == "encoder"  # older checkpoints


def test_an_encoder_decoder_checkpoint_reloads_exactly(tmp_path) -> None:
    build_tiny("t5", LAYERS).save_pretrained(tmp_path / "t5")
    heads = [
        HeadConfig("lm_head", is_causal_lm=True, stack="decoder"),
        HeadConfig("syntax", layer_hook=1, num_outputs=4),
        HeadConfig("value", num_outputs=1, stack="decoder", pred_for_sequence=True),
    ]
    model = load_headed(str(tmp_path / "t5"), head_configs=heads)
    assert type(model.backbone).__name__ == "T5ForConditionalGeneration"  # its LM head too
    with torch.no_grad():
        for p in model.heads["value"].parameters():
            p.normal_()
    batch = _batch("t5")
    expected = model(**batch).preds_by_head
    model.save_pretrained(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / "head_configs.json").read_text())
    assert manifest["backbone"]["kind"] == "reference"
    assert {h["name"]: h.get("stack") for h in manifest["heads"]} == {
        "lm_head": "decoder",
        "syntax": None,
        "value": "decoder",
    }
    reloaded = HeadedModel.from_pretrained(tmp_path / "ckpt")
    got = reloaded(**batch).preds_by_head
    assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_compiles_as_one_graph_reading_transformers_capture_hooks() -> None:
    heads = [h for h in _heads("encoder") + _heads("decoder") if h.layer_hook == 1]
    model = HeadedModel(build_tiny("t5", LAYERS), heads, check_inputs=False)
    assert_compiles_like_eager(model, _batch("t5"))


def test_cached_features_of_both_stacks_equal_forward() -> None:
    heads = [
        HeadConfig("enc", layer_hook=1, pred_for_sequence=True, pooling="mean", num_outputs=2),
        HeadConfig("dec", layer_hook=1, pred_for_sequence=True, stack="decoder", num_outputs=2),
    ]
    model = HeadedModel(build_tiny("bart", LAYERS), heads)
    batch = _batch("bart")
    examples = [
        {
            "input_ids": batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist(),
            "decoder_input_ids": batch["decoder_input_ids"][i][
                batch["decoder_attention_mask"][i].bool()
            ].tolist(),
            "enc": i,
            "dec": 1 - i,
        }
        for i in range(2)
    ]
    cached = cache_features(model, examples, batch_size=2, progress=False)
    out = model(**batch)
    for name in ("enc", "dec"):
        features = torch.as_tensor(cached.features(name))
        torch.testing.assert_close(
            model.heads[name].from_features(features), out.preds_by_head[name]
        )
    decoder_only = HeadedModel(model.backbone, heads[1:])  # no encoder state is read
    only = cache_features(decoder_only, examples, batch_size=2, progress=False)
    torch.testing.assert_close(
        decoder_only.heads["dec"].from_features(torch.as_tensor(only.features("dec"))),
        decoder_only(**batch).preds_by_head["dec"],
    )
    tagger = HeadedModel(
        build_tiny("bart", LAYERS), [HeadConfig("tags", stack="decoder", num_outputs=2)]
    )
    with pytest.raises(ConfigError, match=r"head 'tags' reads the decoder per position"):
        cache_features(tagger, examples, progress=False)


def test_exports_to_text_formats_refuse_encoder_decoder_models(tmp_path) -> None:
    pytest.importorskip("onnx")
    import headkit

    model = HeadedModel(build_tiny("t5", LAYERS), [HeadConfig("syntax", pred_for_sequence=True)])
    with pytest.raises(
        ConfigError, match=r"T5ForConditionalGeneration is an encoder–decoder model"
    ):
        headkit.export(model, tmp_path / "onnx", format="onnx")
    with pytest.raises(ConfigError, match=r"the backbone is an encoder–decoder model"):
        headkit.export(model, tmp_path / "hf", format="transformers")


def test_lora_and_training_reach_every_block_a_decoder_head_runs(tmp_path) -> None:
    from peft import LoraConfig

    from headkit import create_headed_qlora

    build_tiny("t5", 3).save_pretrained(tmp_path / "t5")
    head = HeadConfig("v", stack="decoder", layer_hook=1, pred_for_sequence=True, num_outputs=1)
    model = create_headed_qlora(
        tmp_path / "t5", head_configs=[head], lora_config=LoraConfig(r=2, lora_alpha=4)
    )
    adapted = {n for n, _ in model.backbone.named_parameters() if ".lora_" in n}
    blocks = {tuple(n.split(".")[:3]) for n in adapted}
    expected = {("encoder", "block", str(i)) for i in range(3)} | {("decoder", "block", "0")}
    assert blocks == expected  # the whole encoder runs; the decoder up to layer 1
    trainable = HeadedModel(build_tiny("t5", 3), [head], freeze_base_model=False)
    encoder = [p for n, p in trainable.backbone.named_parameters() if n.startswith("encoder.")]
    assert encoder and all(p.requires_grad for p in encoder)  # nothing frozen as unreached
