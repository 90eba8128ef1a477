"""Processors, files and data with planted signals for the tiny vision, speech and
vision-language models of conftest, all built offline from their classes.

- ``image_processor`` (ViT's PIL backend: 32x32, no torchvision), ``clip_image_processor``;
- ``speech_feature_extractor`` (wav2vec2's: 16 kHz, with an attention mask) and
  ``whisper_feature_extractor`` (8 mel bins over 32 frames of one second);
- ``vlm_tokenizer`` (a fast tokenizer from the ``tokenizers`` library whose ``<image>`` is
  id ``IMAGE_TOKEN``) and ``llava_processor`` (it expands ``<image>`` to 16 patch tokens);
- ``planted_images`` (red or blue squares: the label) and ``planted_audio`` (a low or high
  tone: the label), with ``write_png`` / ``write_wav`` to put them in files;
- ``assert_heads_match_hf``: each head of a HeadedModel equals the same head applied to HF's
  own ``output_hidden_states``.
"""

from __future__ import annotations

import random
import wave
from pathlib import Path

import numpy as np
import torch
from conftest import IMAGE_SIZE, IMAGE_TOKEN, MEL_BINS, MEL_FRAMES, PATCH, VOCAB
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    CLIPImageProcessorPil,
    LlavaProcessor,
    PreTrainedTokenizerFast,
    ViTImageProcessorPil,
    Wav2Vec2FeatureExtractor,
    WhisperFeatureExtractor,
)

from headkit import HeadConfig, HeadedModel

RATE = 16_000


def image_processor() -> ViTImageProcessorPil:
    """ViT's image processor (PIL backend): any image → (3, 32, 32), normalised."""
    return ViTImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def clip_image_processor() -> CLIPImageProcessorPil:
    """CLIP's image processor (PIL backend) for 32x32 images (Llava's)."""
    return CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )


def speech_feature_extractor() -> Wav2Vec2FeatureExtractor:
    """wav2vec2's feature extractor: 16 kHz samples, normalised, with an attention mask."""
    return Wav2Vec2FeatureExtractor(
        feature_size=1,
        sampling_rate=RATE,
        padding_value=0.0,
        do_normalize=True,
        return_attention_mask=True,
    )


def whisper_feature_extractor() -> WhisperFeatureExtractor:
    """Whisper's feature extractor for the tiny Whisper: one second → 8 mel bins x 32 frames."""
    return WhisperFeatureExtractor(
        feature_size=MEL_BINS, sampling_rate=RATE, hop_length=RATE // MEL_FRAMES, chunk_length=1
    )


def vlm_tokenizer() -> PreTrainedTokenizerFast:
    """Words ``w0``..``w39`` and fillers up to ``<image>`` = ``IMAGE_TOKEN`` (the last id)."""
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    words = [f"w{i}" for i in range(40)]
    fillers = [f"x{i}" for i in range(VOCAB - 1 - len(specials) - len(words))]
    vocab = {t: i for i, t in enumerate(specials + words + fillers + ["<image>"])}
    assert vocab["<image>"] == IMAGE_TOKEN
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>"},
    )


def llava_processor() -> LlavaProcessor:
    """Llava's processor for the tiny Llava: ``<image>`` becomes its 16 patch tokens."""
    return LlavaProcessor(
        image_processor=clip_image_processor(),
        tokenizer=vlm_tokenizer(),
        patch_size=PATCH,
        vision_feature_select_strategy="default",  # the CLS token dropped ...
        num_additional_image_tokens=1,  # ... from the patches and the CLS token
    )


def planted_images(n: int, seed: int = 0, size: int = 40) -> tuple[list[Image.Image], list[int]]:
    """Noisy squares, mostly red (label 0) or mostly blue (label 1)."""
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for i in range(n):
        label = i % 2
        pixels = rng.integers(0, 90, (size, size, 3))
        pixels[..., 2 if label else 0] += 160
        images.append(Image.fromarray(pixels.astype(np.uint8)))
        labels.append(label)
    return images, labels


def planted_audio(n: int, seed: int = 0) -> tuple[list[np.ndarray], list[int]]:
    """0.05-0.1 s of a 300 Hz (label 0) or 3 kHz (label 1) tone in noise, float32 at 16 kHz."""
    rng = random.Random(seed)
    clips, labels = [], []
    for i in range(n):
        label = i % 2
        t = np.arange(rng.randint(800, 1600)) / RATE
        tone = np.sin(2 * np.pi * (3000 if label else 300) * t + rng.random())
        noise = np.random.default_rng(seed * 1000 + i).normal(0, 0.3, t.shape)
        clips.append((tone + noise).astype(np.float32))
        labels.append(label)
    return clips, labels


def write_png(path: Path, image: Image.Image) -> Path:
    image.save(path, format="PNG")
    return path


def write_wav(path: Path, samples: np.ndarray, rate: int = RATE) -> Path:
    """16-bit mono PCM, written with the standard library."""
    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm.tobytes())
    return path


def assert_heads_match_hf(model, out, states, masks, atol: float = 1e-5) -> None:
    """Each head's predictions in ``out`` equal the head applied to HF's ``states`` (the
    hidden states of the head's stack, by its ``hooked_layers`` index) at ``masks[head]``
    (one mask for all heads, or None): at the real positions for token heads."""
    layers = model.hooked_layers()
    for name, head in model.heads.items():
        mask = masks.get(name) if isinstance(masks, dict) else masks
        expected = head(states[name] if isinstance(states, dict) else states[layers[name]], mask)
        got = out.preds_by_head[name]
        if got.dim() == 3 and mask is not None:
            got, expected = got[mask.bool()], expected[mask.bool()]
        torch.testing.assert_close(got, expected, atol=atol, rtol=1e-5, msg=name)


def heads_at_every_layer(
    layers: int,
    poolings: tuple[str, ...],
    token: str,
    num_outputs: int = 3,
    stack: str | None = None,
) -> list[HeadConfig]:
    """For each hidden state 0..``layers``: a sequence head per pooling (``{pooling}{k}``) and a
    token head (``{token}{k}``), none with a loss; with ``stack``, on that stack and named
    ``{stack}_...``."""
    prefix, on = (f"{stack}_", {"stack": stack}) if stack else ("", {})
    common = {"num_outputs": num_outputs, "loss_fct": None, **on}
    heads = []
    for k in range(layers + 1):
        for pooling in poolings:
            heads.append(
                HeadConfig(
                    f"{prefix}{pooling}{k}",
                    layer_hook=k,
                    pred_for_sequence=True,
                    pooling=pooling,
                    **common,
                )
            )
        heads.append(HeadConfig(f"{prefix}{token}{k}", layer_hook=k, **common))
    return heads


def assert_compiles_like_eager(model: HeadedModel, batch: dict) -> None:
    """``model`` compiles as one graph (``fullgraph=True``) whose predictions on ``batch``
    equal eager's: heads below the last layer read ``hidden_states`` through the capture
    hooks HeadedModel installed beforehand (hooks cannot be added inside a graph)."""
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    got, want = compiled(**batch), model(**batch)
    for name in want.preds_by_head:
        torch.testing.assert_close(got.preds_by_head[name], want.preds_by_head[name])
