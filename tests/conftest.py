"""Shared fixtures: tiny randomly initialised GPT-2 / Llama / BERT, and the packaged MiniLM.

Tiny models are built from configs (nothing is downloaded), seeded, in eval mode, and fresh
for every test, so a test may train or change them. ``make_tiny`` builds any of them with a
chosen depth; ``tiny_gpt2`` / ``tiny_llama`` / ``tiny_bert`` are the common shortcuts.
The real MiniLM is loaded once per session: treat it as read-only (load your own copy with
``AutoModel.from_pretrained(minilm_path())`` to train or change it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

#: Shared sizes of the tiny models (token ids 0..VOCAB-1; PAD is also EOS for the decoders).
VOCAB = 100
HIDDEN = 32
PAD = 2
ARCHS = ("gpt2", "llama", "bert")


def build_tiny(arch: str, num_layers: int = 3, seed: int = 0) -> PreTrainedModel:
    """A tiny random model in eval mode: ``GPT2LMHeadModel``, ``LlamaForCausalLM`` or
    ``BertModel`` (hidden 32, vocab 100; decoders use pad == eos == 2)."""
    torch.manual_seed(seed)
    if arch == "gpt2":
        cfg = GPT2Config(
            n_layer=num_layers,
            n_embd=HIDDEN,
            n_head=4,
            n_positions=64,
            vocab_size=VOCAB,
            bos_token_id=1,
            eos_token_id=PAD,
            pad_token_id=PAD,
        )
        model = GPT2LMHeadModel(cfg)
    elif arch == "llama":
        cfg = LlamaConfig(
            num_hidden_layers=num_layers,
            hidden_size=HIDDEN,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            vocab_size=VOCAB,
            bos_token_id=1,
            eos_token_id=PAD,
            pad_token_id=PAD,
        )
        model = LlamaForCausalLM(cfg)
    elif arch == "bert":
        cfg = BertConfig(
            num_hidden_layers=num_layers,
            hidden_size=HIDDEN,
            intermediate_size=64,
            num_attention_heads=4,
            max_position_embeddings=64,
            vocab_size=VOCAB,
            pad_token_id=0,
        )
        model = BertModel(cfg)
    else:
        raise ValueError(f"arch={arch!r} is unknown; allowed: {', '.join(ARCHS)}")
    return model.eval()


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
def minilm():
    """(model, tokenizer) of the packaged all-MiniLM-L6-v2, loaded once; read-only."""
    from transformers import AutoModel, AutoTokenizer

    from headkit.packaged import minilm_path

    path = minilm_path()
    model = AutoModel.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
