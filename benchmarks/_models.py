"""The models and batches every benchmark scenario uses: random GPT-2, Llama and BERT from configs.

Nothing is downloaded. Sizes come from ``Sizes`` (12 layers, hidden 256, batch 8 x 128 by
default; ``--layers/--hidden`` for the larger GPU run). Models are seeded, so two builds of
the same arch hold the same weights.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2Model,
    LlamaConfig,
    LlamaModel,
    PreTrainedModel,
)

ARCHS = ("gpt2", "llama", "bert")
VOCAB = 1000


@dataclass(frozen=True)
class Sizes:
    layers: int = 12
    hidden: int = 256
    batch: int = 8
    seq: int = 128
    mem_batch: int = 32  # peak memory: a batch where activations dominate allocator noise
    mem_seq: int = 256

    @property
    def heads(self) -> int:
        return max(1, self.hidden // 64)

    @property
    def max_positions(self) -> int:
        return max(512, self.seq, self.mem_seq)


def build(arch: str, sizes: Sizes, seed: int = 0) -> PreTrainedModel:
    """A bare random transformer (``GPT2Model``, ``LlamaModel``, ``BertModel``) in eval mode."""
    torch.manual_seed(seed)
    h = sizes.hidden
    if arch == "gpt2":
        cfg = GPT2Config(
            n_layer=sizes.layers,
            n_embd=h,
            n_head=sizes.heads,
            vocab_size=VOCAB,
            n_positions=sizes.max_positions,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = GPT2Model(cfg)
    elif arch == "llama":
        cfg = LlamaConfig(
            num_hidden_layers=sizes.layers,
            hidden_size=h,
            intermediate_size=4 * h,
            num_attention_heads=sizes.heads,
            num_key_value_heads=sizes.heads,
            vocab_size=VOCAB,
            max_position_embeddings=sizes.max_positions,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        model = LlamaModel(cfg)
    elif arch == "bert":
        cfg = BertConfig(
            num_hidden_layers=sizes.layers,
            hidden_size=h,
            intermediate_size=4 * h,
            num_attention_heads=sizes.heads,
            vocab_size=VOCAB,
            max_position_embeddings=sizes.max_positions,
            pad_token_id=0,
        )
        model = BertModel(cfg)
    else:
        raise ValueError(f"arch={arch!r} is unknown; allowed: {', '.join(ARCHS)}")
    return model.eval()


def call_kwargs(model: nn.Module) -> dict:
    """Keyword arguments every bare-model call gets: no KV cache where the model has one."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return {"use_cache": False} if "use_cache" in params else {}


def truncated(model: PreTrainedModel, layers_path: str, k: int) -> PreTrainedModel:
    """A copy of ``model`` holding only its first k blocks: the cost floor of a layer-k probe.

    ``layers_path`` is where the block stack lives (``HeadedModel(...).info.layers_path``).
    """
    m = copy.deepcopy(model)
    parent_path, _, name = layers_path.rpartition(".")
    parent = m.get_submodule(parent_path) if parent_path else m
    setattr(parent, name, nn.ModuleList(list(getattr(parent, name))[:k]))
    m.config.num_hidden_layers = k
    if hasattr(m.config, "n_layer"):
        m.config.n_layer = k
    return m


def token_ids(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    """(batch, seq) random ids 1..VOCAB-1 (0 is the pad id)."""
    return torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def padded_mask(batch: int, seq: int, seed: int = 2) -> torch.Tensor:
    """(batch, seq) right-padding mask; lengths uniform in [seq/2, seq], the first row full."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, seq // 2), seq + 1, (batch,), generator=g)
    lengths[0] = seq
    return (torch.arange(seq)[None, :] < lengths[:, None]).long()
