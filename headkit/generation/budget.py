"""Size caps of ``HeadedModel.generate``, checked before anything is allocated.

Two checks, on the settings generate will use:

- rows: ``num_return_sequences`` is 1 to MAX_RETURN_SEQUENCES per prompt;
- memory: what the call must keep, ``batch × num_return_sequences`` rows of ``prompt +
  max_new_tokens`` positions, each holding the KV cache of the blocks that run (keys and
  values) and the states recorded for sequence heads, plus a row's next-token logits. That
  lower bound must fit in the memory the backbone's device has free (CUDA:
  ``torch.cuda.mem_get_info``; CPU: ``MemAvailable`` of ``/proc/meminfo``). Where free
  memory cannot be read, only the row cap applies.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import ConfigError

#: The most sequences generate returns per prompt.
MAX_RETURN_SEQUENCES = 10_000


def check_generation_size(
    model: Any, shape: tuple[int, int], cfg: Any, layers: set[int], recorded: int
) -> None:
    """Refuse a generate call beyond the caps (module docstring) with a ConfigError.

    ``shape``: (batch, prompt positions) of what the decoder starts from (``prompt_shape``);
    ``cfg``: the effective GenerationConfig; ``layers``: the hidden-state indices the call
    reads (the deepest one tells how many blocks run and keep a cache); ``recorded``: how
    many of them are recorded at every position for sequence heads."""
    n = cfg.num_return_sequences if cfg.num_return_sequences is not None else 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_RETURN_SEQUENCES:
        raise ConfigError(
            f"num_return_sequences={n!r} is invalid; 1 to {MAX_RETURN_SEQUENCES} sequences "
            "per prompt (MAX_RETURN_SEQUENCES)"
        )
    batch, prompt = shape
    new = cfg.max_new_tokens if cfg.max_new_tokens is not None else cfg.max_length - prompt
    rows, positions = batch * n, prompt + max(int(new or 0), 0)
    need = rows * (positions * _bytes_per_position(model, layers, recorded) + _bytes_per_row(model))
    free = _free_memory(model.backbone.device)
    if free is not None and need > free:
        raise ConfigError(
            f"generate with batch {batch} × num_return_sequences {n} = {rows} rows of "
            f"{prompt} + {positions - prompt} positions needs at least {need / 2**30:.1f} GiB "
            f"(KV cache and logits), but the {model.backbone.device} device has "
            f"{free / 2**30:.1f} GiB free; lower num_return_sequences, max_new_tokens or the "
            "batch"
        )


def prompt_shape(model: Any, input_ids: Any, kwargs: dict[str, Any]) -> tuple[int, int]:
    """(batch, prompt positions) a generate call starts from: its prompts; on an
    encoder–decoder model the decoder's start (``decoder_input_ids``, else one token) for a
    batch of the encoder's input (``input_ids``, ``input_features``, ...)."""
    if input_ids is not None and not model.info.encoder_decoder:
        return int(input_ids.shape[0]), int(input_ids.shape[-1])
    main = input_ids if input_ids is not None else kwargs.get(model.info.main_input)
    start = kwargs.get("decoder_input_ids")
    batch = int(main.shape[0]) if isinstance(main, torch.Tensor) else 1
    return batch, int(start.shape[-1]) if isinstance(start, torch.Tensor) else 1


def _bytes_per_position(model: Any, layers: set[int], recorded: int) -> int:
    cfg = model.backbone.config.get_text_config()
    hidden = int(model.info.hidden_size)
    heads = getattr(cfg, "num_attention_heads", None) or 1
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    size = torch.empty((), dtype=model.backbone.dtype).element_size()
    blocks = max(max(layers, default=1), 1)
    return size * (2 * blocks * kv_heads * head_dim + recorded * hidden)


def _bytes_per_row(model: Any) -> int:
    return 4 * 2 * int(model.info.vocab_size or 0)  # a step's logits and their log-softmax


def _free_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` (None where that cannot be read)."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        if device.type == "cpu":
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, RuntimeError, AttributeError):
        return None
    return None
