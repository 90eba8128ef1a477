"""Shared fixtures and the one factory of tiny random models every test builds from.

Tiny models are built from configs (nothing is downloaded), seeded, in eval mode, and fresh
for every call, so a test may train or change them. ``build_tiny(arch, num_layers, task=...,
**overrides)`` builds any architecture the tests use (``TINY`` lists them) as its default
class or for a task; ``tiny_config`` gives the config alone. ``tiny_gpt2`` / ``tiny_llama`` /
``tiny_bert`` are the common fixtures. The real models are loaded once per session and
are read-only: ``minilm`` (model, tokenizer), ``minilm_tokenizer``, ``minilm_st`` (as a
SentenceTransformer) and ``smollm2``; load your own copy to train or change one.
Multi-process tests use tests/multiproc.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import transformers
from transformers import (
    BertModel,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

#: Shared sizes of the tiny models (token ids 0..VOCAB-1; PAD is also EOS for the decoders).
VOCAB = 100
HIDDEN = 32
PAD = 2
#: The three architectures most tests run on (``tiny_any`` gives each in turn).
ARCHS = ("gpt2", "llama", "bert")


@dataclass(frozen=True)
class TinyArch:
    """How ``build_tiny`` makes one architecture: its config class, the model class built
    when no task is asked for, the config values beyond the shared sizes, and the names of
    its dropout probabilities (``build_tiny(..., dropout=0.0)`` sets them all).

    ``layers`` names the config fields set to ``num_layers`` (an encoder–decoder model's two
    stacks); ``shared=False`` leaves the shared text sizes out (vision and speech configs
    name theirs in ``values``); ``text`` names the architecture whose tiny config becomes a
    vision-language model's ``text_config`` (``num_layers`` and ``dropout`` go to it)."""

    config: str
    default: str
    values: dict[str, Any] = field(default_factory=dict)
    dropouts: tuple[str, ...] = ()
    layers: tuple[str, ...] = ("num_hidden_layers",)
    shared: bool = True
    text: str | None = None


#: Shared by every architecture (the configs map these names to their own, e.g. n_embd).
SHARED = {
    "hidden_size": HIDDEN,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "vocab_size": VOCAB,
}
_DECODER_IDS = {"bos_token_id": 1, "eos_token_id": PAD, "pad_token_id": PAD}
_BERT_DROPOUTS = ("hidden_dropout_prob", "attention_probs_dropout_prob")
TINY = {
    "gpt2": TinyArch(
        "GPT2Config", "GPT2LMHeadModel", _DECODER_IDS, ("resid_pdrop", "embd_pdrop", "attn_pdrop")
    ),
    "llama": TinyArch(
        "LlamaConfig",
        "LlamaForCausalLM",
        {"intermediate_size": 64, "num_key_value_heads": 2, **_DECODER_IDS},
        ("attention_dropout",),
    ),
    "bert": TinyArch(
        "BertConfig", "BertModel", {"intermediate_size": 64, "pad_token_id": 0}, _BERT_DROPOUTS
    ),
    # RoBERTa numbers positions from padding_idx + 1: 66 rows give 64 positions.
    "roberta": TinyArch(
        "RobertaConfig",
        "RobertaModel",
        {"intermediate_size": 64, "max_position_embeddings": 66, "pad_token_id": 1},
        _BERT_DROPOUTS,
    ),
    "distilbert": TinyArch(
        "DistilBertConfig",
        "DistilBertModel",
        {"hidden_dim": 64, "pad_token_id": 0},
        ("dropout", "attention_dropout"),
    ),
    # Llama's relatives: sliding-window attention (Mistral), q/k/v biases (Qwen2), embeddings
    # scaled by sqrt(hidden) and (1 + w) norms (Gemma)
    "mistral": TinyArch(
        "MistralConfig",
        "MistralForCausalLM",
        {"intermediate_size": 64, "num_key_value_heads": 2, "sliding_window": 4, **_DECODER_IDS},
        ("attention_dropout",),
    ),
    "qwen2": TinyArch(
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"intermediate_size": 64, "num_key_value_heads": 2, **_DECODER_IDS},
        ("attention_dropout",),
    ),
    "gemma": TinyArch(
        "GemmaConfig",
        "GemmaForCausalLM",
        {"intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 8, **_DECODER_IDS},
        ("attention_dropout",),
    ),
    # Bloom (ALiBi) has no position table and its forward takes no position_ids.
    "bloom": TinyArch(
        "BloomConfig",
        "BloomModel",
        {"max_position_embeddings": None},
        ("hidden_dropout", "attention_dropout"),
    ),
}
#: Image and audio sizes of the tiny vision and speech models: 32x32 RGB images in 8x8
#: patches (16 patches + CLS), audio at 16 kHz, Whisper's 8 mel bins over 32 frames.
IMAGE_SIZE = 32
PATCH = 8
MEL_BINS = 8
MEL_FRAMES = 32
#: The image token of the tiny Llava (and the image/video/markers of the tiny Qwen2-VL).
IMAGE_TOKEN = 99
#: The register tokens of the tiny DINOv2 with registers.
REGISTERS = 2
#: Image tokens per 32x32 image of the tiny Idefics3 (16 patches merged 2x2).
IDEFICS3_IMAGE_TOKENS = 4
_VIT_SIZES = {
    "hidden_size": HIDDEN,
    "num_attention_heads": 4,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH,
}
_VIT = {**_VIT_SIZES, "intermediate_size": 64}
_SPEECH = {
    "hidden_size": HIDDEN,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "conv_dim": (16, 16),
    "conv_stride": (5, 2),
    "conv_kernel": (10, 3),
    "num_conv_pos_embeddings": 8,
    "num_conv_pos_embedding_groups": 2,
    "feat_extract_norm": "layer",
    "do_stable_layer_norm": True,
    "classifier_proj_size": 16,
}
_SEQ2SEQ = {
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
}
_SEQ2SEQ_DROPOUTS = ("dropout", "attention_dropout", "activation_dropout")
TINY.update(
    {
        "vit": TinyArch(
            "ViTConfig",
            "ViTModel",
            _VIT,
            ("hidden_dropout_prob", "attention_probs_dropout_prob"),
            shared=False,
        ),
        "clip-vision": TinyArch(
            "CLIPVisionConfig", "CLIPVisionModel", _VIT, ("attention_dropout",), shared=False
        ),
        "dinov2": TinyArch(
            "Dinov2Config",
            "Dinov2Model",
            {**_VIT_SIZES, "mlp_ratio": 2},
            ("hidden_dropout_prob", "attention_probs_dropout_prob"),
            shared=False,
        ),
        # DINOv2 with register tokens: CLS, then the registers, then the patches
        "dinov2-registers": TinyArch(
            "Dinov2WithRegistersConfig",
            "Dinov2WithRegistersModel",
            {**_VIT_SIZES, "mlp_ratio": 2, "num_register_tokens": REGISTERS},
            ("hidden_dropout_prob", "attention_probs_dropout_prob"),
            shared=False,
        ),
        # SigLIP's vision tower: no CLS token; its pooler_output is an attention-pooling head
        "siglip-vision": TinyArch(
            "SiglipVisionConfig", "SiglipVisionModel", _VIT, ("attention_dropout",), shared=False
        ),
        # Swin: hierarchical, two stages of one block each (``num_layers`` is not used)
        "swin": TinyArch(
            "SwinConfig",
            "SwinModel",
            {
                "image_size": IMAGE_SIZE,
                "patch_size": 4,
                "embed_dim": HIDDEN // 2,
                "depths": [1, 1],
                "num_heads": [2, 2],
                "window_size": 4,
            },
            ("hidden_dropout_prob", "attention_probs_dropout_prob"),
            layers=(),
            shared=False,
        ),
        "wav2vec2": TinyArch(
            "Wav2Vec2Config",
            "Wav2Vec2Model",
            _SPEECH,
            ("hidden_dropout", "attention_dropout", "activation_dropout", "feat_proj_dropout"),
            shared=False,
        ),
        "hubert": TinyArch(
            "HubertConfig",
            "HubertModel",
            _SPEECH,
            ("hidden_dropout", "attention_dropout", "activation_dropout", "feat_proj_dropout"),
            shared=False,
        ),
        # WavLM: a relative position bias computed by the first block and passed down
        "wavlm": TinyArch(
            "WavLMConfig",
            "WavLMModel",
            {**_SPEECH, "num_buckets": 16, "max_bucket_distance": 32},
            ("hidden_dropout", "attention_dropout", "activation_dropout", "feat_proj_dropout"),
            shared=False,
        ),
        "whisper": TinyArch(
            "WhisperConfig",
            "WhisperModel",
            {
                **_SEQ2SEQ,
                "num_mel_bins": MEL_BINS,
                "max_source_positions": MEL_FRAMES // 2,
                "max_target_positions": 64,
                "decoder_start_token_id": 1,
                "begin_suppress_tokens": None,
                "suppress_tokens": None,
                **_DECODER_IDS,
            },
            _SEQ2SEQ_DROPOUTS,
            layers=("encoder_layers", "decoder_layers"),
        ),
        "t5": TinyArch(
            "T5Config",
            "T5ForConditionalGeneration",
            {
                "d_kv": 8,
                "d_ff": 64,
                "pad_token_id": 0,
                "eos_token_id": 1,
                "decoder_start_token_id": 0,
            },
            ("dropout_rate",),
            layers=("num_layers", "num_decoder_layers"),
        ),
        "bart": TinyArch(
            "BartConfig",
            "BartModel",
            {**_SEQ2SEQ, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2},
            _SEQ2SEQ_DROPOUTS,
            layers=("encoder_layers", "decoder_layers"),
        ),
        "mbart": TinyArch(
            "MBartConfig",
            "MBartModel",
            {
                **_SEQ2SEQ,
                "pad_token_id": 1,
                "bos_token_id": 0,
                "eos_token_id": 2,
                "decoder_start_token_id": 2,
            },
            _SEQ2SEQ_DROPOUTS,
            layers=("encoder_layers", "decoder_layers"),
        ),
        "llava": TinyArch(
            "LlavaConfig",
            "LlavaForConditionalGeneration",
            {
                "vision_config": {
                    "model_type": "clip_vision_model",
                    "num_hidden_layers": 2,
                    **_VIT,
                },
                "image_token_id": IMAGE_TOKEN,
                "vision_feature_layer": -1,
                "projector_hidden_act": "gelu",
            },
            shared=False,
            text="llama",
        ),
        # Idefics3 (SmolVLM): a SigLIP-style vision tower, a pixel shuffle that merges 2x2
        # patches (16 patches -> IDEFICS3_IMAGE_TOKENS image tokens) and a Llama
        "idefics3": TinyArch(
            "Idefics3Config",
            "Idefics3ForConditionalGeneration",
            {
                "vision_config": {**_VIT, "num_hidden_layers": 2},
                "image_token_id": IMAGE_TOKEN,
                "scale_factor": 2,
                "pad_token_id": PAD,
            },
            shared=False,
            text="llama",
        ),
        "qwen2-vl": TinyArch(
            "Qwen2VLConfig",
            "Qwen2VLForConditionalGeneration",
            {
                "vision_config": {
                    "depth": 2,
                    "embed_dim": 16,
                    "hidden_size": HIDDEN,
                    "num_heads": 4,
                    "mlp_ratio": 2,
                    "patch_size": 2,
                    "spatial_merge_size": 2,
                    "temporal_patch_size": 2,
                },
                "image_token_id": 96,
                "video_token_id": 97,
                "vision_start_token_id": 98,
                "vision_end_token_id": IMAGE_TOKEN,
            },
            shared=False,
            text="qwen2-vl-text",
        ),
        "qwen2-vl-text": TinyArch(
            "Qwen2VLTextConfig",
            "Qwen2VLTextModel",
            {
                "intermediate_size": 64,
                "num_key_value_heads": 2,
                "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
                **_DECODER_IDS,
            },
        ),
    }
)
#: ``task`` of ``build_tiny``: the Auto class that builds the model for it.
TASKS = {
    "base": "AutoModel",
    "causal-lm": "AutoModelForCausalLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "image-classification": "AutoModelForImageClassification",
    "audio-classification": "AutoModelForAudioClassification",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "speech-seq2seq": "AutoModelForSpeechSeq2Seq",
    "image-text-to-text": "AutoModelForImageTextToText",
}


def tiny_config(
    arch: str, num_layers: int = 3, *, dropout: float | None = None, **overrides: Any
) -> PretrainedConfig:
    """The config of a tiny ``arch`` (see ``TINY``) with ``num_layers`` blocks; ``overrides``
    are config fields, by the config's own name or the common one (``hidden_size``,
    ``num_attention_heads``, ...); ``dropout`` sets every dropout probability of ``arch``."""
    if arch not in TINY:
        raise ValueError(f"arch={arch!r} is unknown; allowed: {', '.join(TINY)}")
    spec = TINY[arch]
    values = {**(SHARED if spec.shared else {}), **spec.values}
    if spec.text is not None:
        values["text_config"] = tiny_config(spec.text, num_layers, dropout=dropout).to_dict()
    else:
        values.update(dict.fromkeys(spec.layers, num_layers))
    if dropout is not None:
        values.update(dict.fromkeys(spec.dropouts, dropout))
    values.update(overrides)
    values = {k: v for k, v in values.items() if not (k in SHARED and v is None)}
    return getattr(transformers, spec.config)(**values)


def build_tiny(
    arch: str,
    num_layers: int = 3,
    *,
    seed: int = 0,
    task: str | None = None,
    model_kwargs: dict[str, Any] | None = None,
    dropout: float | None = None,
    **overrides: Any,
) -> PreTrainedModel:
    """A tiny random ``arch`` in eval mode, seeded with ``seed``: the architecture's default
    class (``TINY[arch].default``: GPT2LMHeadModel, LlamaForCausalLM, BertModel, ViTModel,
    Wav2Vec2Model, WhisperModel, T5ForConditionalGeneration, LlavaForConditionalGeneration,
    ...) or the class for ``task`` (one of ``TASKS``). Hidden 32, vocab 100, 4 attention
    heads, 64 positions; decoders use bos 1 and pad == eos == 2; vision models take 32x32
    images in 8x8 patches (Swin: 4x4, in two stages whatever ``num_layers``); Llava's and
    Idefics3's image token is ``IMAGE_TOKEN``. ``overrides`` and
    ``dropout`` go to ``tiny_config``, ``model_kwargs`` to the model class."""
    config = tiny_config(arch, num_layers, dropout=dropout, **overrides)
    if task is not None and task not in TASKS:
        raise ValueError(f"task={task!r} is unknown; allowed: {', '.join(TASKS)}")
    torch.manual_seed(seed)
    if task is None:
        model = getattr(transformers, TINY[arch].default)(config, **(model_kwargs or {}))
    else:
        model = getattr(transformers, TASKS[task]).from_config(config, **(model_kwargs or {}))
    return model.eval()


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist the workers share the cores: each gets its share of torch threads."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules holding ``slow`` tests run first. pytest-xdist hands out whole modules
    (``--dist loadscope``) in this order, so the longest go out first and the workers finish
    together (longest processing time first) instead of one running a long module alone."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: the rest keep their order


def blocks_of(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The transformer blocks of a tiny model, found by its own attribute names (not headkit's)."""
    if isinstance(model, GPT2LMHeadModel):
        return model.transformer.h
    if isinstance(model, LlamaForCausalLM):
        return model.model.layers
    if isinstance(model, BertModel):
        return model.encoder.layer
    raise TypeError(f"no known block list for {type(model).__name__}")


@pytest.fixture
def single_thread() -> Iterator[None]:
    """Run the test on one CPU thread (tiny models gain nothing from more, and on a shared
    machine extra threads oversubscribe the cores); restores the previous count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_tiny() -> Callable[..., PreTrainedModel]:
    """Factory fixture: ``make_tiny("llama", num_layers=12)``."""
    return build_tiny


@pytest.fixture
def tiny_gpt2() -> GPT2LMHeadModel:
    """A 3-block GPT2LMHeadModel (hidden 32, vocab 100, pad == eos == 2)."""
    return build_tiny("gpt2")


@pytest.fixture
def tiny_llama() -> LlamaForCausalLM:
    """A 3-block LlamaForCausalLM (hidden 32, vocab 100, pad == eos == 2)."""
    return build_tiny("llama")


@pytest.fixture
def tiny_bert() -> BertModel:
    """A 3-block BertModel (hidden 32, vocab 100) with its pooler."""
    return build_tiny("bert")


@pytest.fixture(params=ARCHS)
def tiny_any(request: pytest.FixtureRequest) -> PreTrainedModel:
    """Each of the tiny GPT-2, Llama and BERT in turn."""
    return build_tiny(request.param)


@pytest.fixture
def token_batch() -> dict[str, torch.Tensor]:
    """input_ids (3, 8) of ids 3..99 (never the pad id) with an all-ones attention_mask."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 8), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.fixture(scope="session")
def minilm_tokenizer():
    """The packaged all-MiniLM-L6-v2 tokenizer (BERT WordPiece, 30522 tokens), loaded once."""
    from transformers import AutoTokenizer

    from headkit.packaged import minilm_path

    return AutoTokenizer.from_pretrained(minilm_path())


@pytest.fixture(scope="session")
def minilm(minilm_tokenizer):
    """(model, tokenizer) of the packaged all-MiniLM-L6-v2, loaded once; read-only."""
    from transformers import AutoModel

    from headkit.packaged import minilm_path

    return AutoModel.from_pretrained(minilm_path()).eval(), minilm_tokenizer


@pytest.fixture(scope="session")
def minilm_st():
    """The packaged all-MiniLM-L6-v2 as a SentenceTransformer (Transformer → Pooling(mean) →
    Normalize), loaded once; read-only."""
    import warnings

    from sentence_transformers import SentenceTransformer

    from headkit.packaged import minilm_path

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SentenceTransformer(str(minilm_path()), device="cpu")


@pytest.fixture(scope="session")
def smollm2():
    """The packaged SmolLM2-135M-Instruct, de-quantised from GGUF to float32, loaded once;
    read-only. transformers parses the GGUF file twice (config, then weights) and builds
    gguf's tensor-name map once per module of the model (~400 times): both are pure
    functions of their arguments, so they are memoised during the load (the same weights,
    bit for bit, in 40% of the time)."""
    import functools
    from unittest import mock

    import gguf
    from transformers import AutoModelForCausalLM

    from headkit.packaged import SMOLLM2_GGUF, smollm2_path

    reader = functools.cache(gguf.GGUFReader)
    name_map = functools.cache(gguf.get_tensor_name_map)
    with (
        mock.patch.object(gguf, "GGUFReader", reader),
        mock.patch.object(gguf, "get_tensor_name_map", name_map),
    ):
        model = AutoModelForCausalLM.from_pretrained(smollm2_path(), gguf_file=SMOLLM2_GGUF)
    return model.eval()
