"""transformer-heads' helpers, for notebooks written against it (see docs/migrating.md).

``get_model_params``, ``print_trainable_parameters`` and ``get_top_n_preds`` keep
transformer-heads' signatures and results, with one difference that matters:
headkit's sequence heads predict ``(batch, num_outputs)``, not ``(batch, seq, num_outputs)``,
so ``get_top_n_preds`` reads ``preds[0]`` for them and ``preds[0, -1]`` for token heads.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import torch
import transformers
from transformers import AutoConfig

from ..errors import ConfigError


def get_model_params(model_path: str | os.PathLike) -> dict[str, Any]:
    """The model's config as a dict, plus ``model_class`` (the transformers class named by
    its ``architectures``) and ``hidden_size`` / ``vocab_size`` under those names.

    As transformer-heads' helper: ``params = get_model_params(path)`` then
    ``load_headed(params["model_class"], path, head_configs=[...])``.
    """
    config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=False)
    params = config.to_dict()
    archs = params.get("architectures") or []
    model_class = getattr(transformers, archs[0], None) if archs else None
    if model_class is None:
        raise ConfigError(
            f"get_model_params: the config of {str(model_path)!r} names architectures={archs!r}, "
            "none of which is a transformers class; load the model with AutoModel instead"
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    params["model_class"] = model_class
    params["hidden_size"] = getattr(text, "hidden_size", params.get("hidden_size"))
    params["vocab_size"] = getattr(text, "vocab_size", params.get("vocab_size"))
    return params


def print_trainable_parameters(model: torch.nn.Module, use_4bit: bool = False) -> None:
    """Print all / trainable parameter counts and the counts by dtype (transformer-heads'
    output). ``use_4bit`` halves the trainable count, as transformer-heads does for packed
    4-bit weights."""
    trainable = total = 0
    by_dtype: dict[torch.dtype, int] = defaultdict(int)
    trainable_by_dtype: dict[torch.dtype, int] = defaultdict(int)
    for _, param in model.named_parameters():
        n = param.numel()
        total += n
        by_dtype[param.dtype] += n
        if param.requires_grad:
            trainable += n
            trainable_by_dtype[param.dtype] += n
    if use_4bit:
        trainable /= 2
    share = 100 * trainable / total if total else 0.0
    print(f"all params: {total} || trainable params: {trainable} || trainable%: {share}")
    print("params by dtype:", dict(by_dtype))
    print("trainable params by dtype:", dict(trainable_by_dtype))


@torch.inference_mode()
def get_top_n_preds(n: int, model: Any, text: str, tokenizer: Any) -> dict[str, list[Any]]:
    """The ``n`` highest-scoring outputs of each head for ``text`` (transformer-heads' helper).

    Token heads are read at the last position, sequence heads at their one prediction.
    Causal-LM heads (and heads with one output per vocabulary entry) give decoded tokens,
    other heads their top ``n`` output indices.
    """
    inputs = tokenizer(text, return_tensors="pt").to(model.device)
    out = model(**inputs)
    vocab = getattr(model.info, "vocab_size", None)
    result: dict[str, list[Any]] = {}
    for name, preds in out.preds_by_head.items():
        cfg = model.head_configs[name]
        scores = preds[0] if cfg.pred_for_sequence else preds[0, -1]
        best = torch.topk(scores.float(), min(n, scores.shape[-1])).indices.tolist()
        if cfg.is_causal_lm or (vocab is not None and cfg.num_outputs == vocab):
            result[name] = [tokenizer.decode(i) for i in best]
        else:
            result[name] = best
    return result
