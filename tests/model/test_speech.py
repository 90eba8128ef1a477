"""Heads on speech encoders: wav2vec2 (input_values, its padding mask reduced to frames the
way the model does it) and Whisper's encoder (input_features), early exit, the
Wav2Vec2ForSequenceClassification head reproduced, audio collation and checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import MEL_BINS, MEL_FRAMES, build_tiny
from tiny_media import (
    assert_compiles_like_eager,
    assert_heads_match_hf,
    heads_at_every_layer,
    planted_audio,
    speech_feature_extractor,
    whisper_feature_extractor,
)

from headkit import BatchError, HeadConfig, HeadedCollator, HeadedModel

pytestmark = pytest.mark.usefixtures("single_thread")

LAYERS = 3


def _padded_audio() -> dict[str, torch.Tensor]:
    """Two clips of 1,200 and 700 samples, right-padded, with the sample-level mask."""
    clips, _ = planted_audio(2)
    return speech_feature_extractor()(
        [clips[0][:1200], clips[1][:700]], sampling_rate=16_000, padding=True, return_tensors="pt"
    )


def _heads(num_outputs: int = 3) -> list[HeadConfig]:
    return heads_at_every_layer(LAYERS, ("mean", "max", "last", "first"), "frame", num_outputs)


def _count(model, cls_name: str):
    calls: list[int] = []
    blocks = [m for m in model.modules() if type(m).__name__ == cls_name]
    return calls, [b.register_forward_hook(lambda *_: calls.append(1)) for b in blocks]


def test_wav2vec2_heads_pool_hf_hidden_states_over_the_frames_of_real_audio() -> None:
    backbone = build_tiny("wav2vec2", LAYERS)
    model = HeadedModel(backbone, _heads())
    batch = _padded_audio()
    out = model(**batch)
    hf = backbone(**batch, output_hidden_states=True)
    frames = backbone._get_feature_vector_attention_mask(
        hf.last_hidden_state.shape[1], batch["attention_mask"]
    )
    assert frames.sum(1).tolist()[0] > frames.sum(1).tolist()[1]  # padding reduced to frames
    assert_heads_match_hf(model, out, hf.hidden_states, frames)


def test_a_padded_clip_pools_as_the_same_clip_alone() -> None:
    model = HeadedModel(build_tiny("wav2vec2", LAYERS), _heads())
    batch = _padded_audio()
    alone = speech_feature_extractor()(
        [planted_audio(2)[0][1][:700]], sampling_rate=16_000, return_tensors="pt"
    )
    padded, single = model(**batch), model(**alone)
    for name in model.heads:
        if model.head_configs[name].pred_for_sequence:
            torch.testing.assert_close(
                padded.preds_by_head[name][1], single.preds_by_head[name][0], atol=1e-4, rtol=1e-4
            )


def test_a_head_reproduces_wav2vec2_for_sequence_classification_with_copied_weights() -> None:
    hf = build_tiny("wav2vec2", LAYERS, task="audio-classification", num_labels=3)
    proj = hf.config.classifier_proj_size
    cfg = HeadConfig(
        "speaker",
        num_outputs=3,
        pred_for_sequence=True,
        pooling="mean",  # over the frames of real audio, as HF's classifier does
        last_hidden_state=True,  # after the encoder's final norm
        num_layers=2,
        hidden_size=proj,
        hidden_activation="linear",  # projector then classifier, nothing between
        output_bias=True,
    )
    model = HeadedModel(hf, [cfg])
    first, second = model.heads["speaker"].linears
    with torch.no_grad():
        first.weight.copy_(hf.projector.weight)
        first.bias.copy_(hf.projector.bias)
        second.weight.copy_(hf.classifier.weight)
        second.bias.copy_(hf.classifier.bias)
    batch = _padded_audio()
    torch.testing.assert_close(model(**batch).logits, hf(**batch).logits)


def test_early_exit_runs_only_the_speech_blocks_a_head_needs() -> None:
    backbone = build_tiny("wav2vec2", 4)
    batch = _padded_audio()
    for layer, expected in ((0, 0), (2, 2), (-1, 4)):
        model = HeadedModel(backbone, [HeadConfig("h", layer_hook=layer, pred_for_sequence=True)])
        calls, handles = _count(backbone, "Wav2Vec2EncoderLayerStableLayerNorm")
        try:
            model(**batch)
        finally:
            for h in handles:
                h.remove()
        assert len(calls) == expected


def test_whisper_encoder_heads_run_the_encoder_alone_over_the_real_frames() -> None:
    backbone = build_tiny("whisper", LAYERS)
    rng = np.random.default_rng(0)
    batch = whisper_feature_extractor()(
        [rng.normal(size=12_000), rng.normal(size=6_000)],  # 3/4 and 3/8 of a second
        sampling_rate=16_000,
        return_attention_mask=True,
        return_tensors="pt",
    )
    assert batch["input_features"].shape == (2, MEL_BINS, MEL_FRAMES)
    model = HeadedModel(backbone, _heads())
    assert model.head_configs["mean0"].stack == "encoder"
    decoder_calls, handles = _count(backbone, "WhisperDecoderLayer")
    try:
        out = model(**batch)  # no decoder inputs needed
    finally:
        for h in handles:
            h.remove()
    assert not decoder_calls
    hf = backbone.encoder(batch["input_features"], output_hidden_states=True)
    frames = backbone._get_feat_extract_output_lengths(batch["attention_mask"].sum(-1))
    mask = torch.arange(MEL_FRAMES // 2) < frames.unsqueeze(-1)  # the encoder halves the frames
    assert mask.sum(1).tolist() == [12, 6]
    assert_heads_match_hf(model, out, hf.hidden_states, mask)
    everything = model(input_features=batch["input_features"])  # no mask: every frame counts
    assert_heads_match_hf(model, everything, hf.hidden_states, None)


def test_audio_examples_are_padded_by_the_collator() -> None:
    model = HeadedModel(
        build_tiny("wav2vec2", 2), [HeadConfig("tone", num_outputs=2, pred_for_sequence=True)]
    )
    clips, labels = planted_audio(3)
    examples = [{"input_values": c, "tone": y} for c, y in zip(clips, labels)]
    batch = HeadedCollator(model)(examples)
    longest = max(len(c) for c in clips)
    assert batch["input_values"].shape == (3, longest)
    assert batch["attention_mask"].sum(1).tolist() == [len(c) for c in clips]
    assert batch["labels"].tolist() == labels
    out = model(**batch)
    for i, clip in enumerate(clips):  # each row as the clip alone
        alone = model(input_values=torch.from_numpy(clip)[None])
        torch.testing.assert_close(out.logits[i], alone.logits[0], atol=1e-4, rtol=1e-4)


def test_frame_labels_are_collated_per_frame_of_real_audio() -> None:
    """A frame (token) head's labels: one per frame of the clip's real audio (the model's own
    count), padded on the right with -100 to the batch's frames whatever ``padding_side``;
    the batch trains as each clip alone (its loss the frame-weighted mean of theirs)."""
    model = HeadedModel(build_tiny("wav2vec2", 2), [HeadConfig("vad", num_outputs=2)])
    clips, _ = planted_audio(3)
    clips = [clips[0], clips[1][:700], clips[2][:450]]
    frames = model.backbone._get_feat_extract_output_lengths(
        torch.tensor([len(c) for c in clips])
    ).tolist()
    g = torch.Generator().manual_seed(0)
    labels = [torch.randint(0, 2, (n,), generator=g).tolist() for n in frames]
    examples = [{"input_values": c, "vad": y} for c, y in zip(clips, labels)]
    batch = HeadedCollator(model, padding_side="left")(examples)
    width = model(**batch).logits.shape[1]
    assert batch["labels"].shape == (3, width) and width == max(frames)
    for row, (n, y) in enumerate(zip(frames, labels)):
        assert batch["labels"][row, :n].tolist() == y
        assert (batch["labels"][row, n:] == -100).all()
    alone = [model(**HeadedCollator(model)([ex])).loss for ex in examples]
    expected = sum(loss * n for loss, n in zip(alone, frames)) / sum(frames)
    torch.testing.assert_close(model(**batch).loss, expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(BatchError, match=rf"has 5 entries, but its audio has {frames[1]} frames"):
        HeadedCollator(model)([examples[0], {**examples[1], "vad": [1] * 5}])


def test_audio_is_checked_before_the_model_runs() -> None:
    model = HeadedModel(build_tiny("wav2vec2", 2), [HeadConfig("h", pred_for_sequence=True)])
    audio = torch.randn(2, 400)
    with pytest.raises(
        BatchError,
        match=r"input_values row 0 has 5 samples of audio, fewer than the 20 that Wav2Vec2Model's "
        r"feature encoder needs for one frame \(its receptive field\); allowed: clips of at least "
        r"20 samples",
    ):
        model(input_values=audio[:, :5])
    short_row = torch.ones(2, 400, dtype=torch.long)
    short_row[1, 3:] = 0  # a 3-sample clip padded beside a long one
    with pytest.raises(BatchError, match=r"input_values row 1 has 3 samples of audio, fewer than"):
        model(input_values=audio, attention_mask=short_row)
    with pytest.raises(
        BatchError, match=r"input_values of shape \(400,\); expected \(batch, samples\)"
    ):
        model(input_values=audio[0])
    with pytest.raises(BatchError, match=r"attention_mask of shape \(2, 300\) does not match"):
        model(input_values=audio, attention_mask=torch.ones(2, 300, dtype=torch.long))
    whisper = HeadedModel(build_tiny("whisper", 2), [HeadConfig("h", pred_for_sequence=True)])
    with pytest.raises(
        BatchError, match=r"has 4 at dim 1, but the model's config has num_mel_bins=8"
    ):
        whisper(input_features=torch.randn(1, 4, MEL_FRAMES))


def test_compiles_as_one_graph_reading_transformers_capture_hooks() -> None:
    heads = [h for h in _heads() if h.layer_hook == 1]
    model = HeadedModel(build_tiny("wav2vec2", LAYERS), heads, check_inputs=False)
    assert_compiles_like_eager(model, dict(_padded_audio()))


def test_audio_examples_must_be_one_sequence_each() -> None:
    model = HeadedModel(
        build_tiny("wav2vec2", 2), [HeadConfig("tone", num_outputs=2, pred_for_sequence=True)]
    )
    with pytest.raises(
        BatchError, match=r"feature 1 has input_values of shape \(2, 400\); expected one"
    ):
        HeadedCollator(model)(
            [{"input_values": np.zeros(400)}, {"input_values": np.zeros((2, 400))}]
        )


def test_speech_heads_pool_the_mean_by_default_and_a_decoder_its_last_token() -> None:
    heads = [
        HeadConfig("enc", pred_for_sequence=True),
        HeadConfig("dec", pred_for_sequence=True, stack="decoder"),
    ]
    whisper = HeadedModel(build_tiny("whisper", 2), heads)
    assert {n: c.pooling for n, c in whisper.head_configs.items()} == {"enc": "mean", "dec": "last"}
    wav2vec2 = HeadedModel(build_tiny("wav2vec2", 2), heads[:1])
    assert wav2vec2.head_configs["enc"].pooling == "mean"  # "first" would be one frame
