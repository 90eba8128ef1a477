"""Where backbones and tokenizers come from: a path, a hub id, or a ``packaged:`` name.

``packaged:minilm`` is the packaged all-MiniLM-L6-v2, ``packaged:smollm2`` the packaged
SmolLM2-135M GGUF (de-quantised to float32). Nothing is downloaded for those.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedModel

from .errors import CheckpointError, ConfigError
from .source import load_backbone

PACKAGED_MODELS = ("packaged:minilm", "packaged:smollm2")
#: from_pretrained keyword arguments a tokenizer needs too.
_TOKENIZER_KWARGS = ("gguf_file", "revision", "subfolder")


def resolve_model(
    source: str | os.PathLike, model_kwargs: dict[str, Any] | None = None
) -> tuple[str, dict[str, Any]]:
    """(path or hub id, from_pretrained kwargs) of ``source``; ``packaged:`` names resolved."""
    kwargs = dict(model_kwargs or {})
    name = str(source)
    if not name.startswith("packaged:"):
        return name, kwargs
    from .packaged import SMOLLM2_GGUF, minilm_path, smollm2_path

    if name == "packaged:minilm":
        return str(minilm_path()), kwargs
    if name == "packaged:smollm2":
        return str(smollm2_path()), {"gguf_file": SMOLLM2_GGUF, "torch_dtype": "float32", **kwargs}
    raise ConfigError(
        f"model={name!r} is not a packaged model; allowed: {', '.join(PACKAGED_MODELS)}"
    )


def load_model(
    source: str | os.PathLike, model_kwargs: dict[str, Any] | None = None, causal_lm: bool = False
) -> PreTrainedModel:
    """``AutoModel`` (or ``AutoModelForCausalLM``) from ``source``, in eval mode, through
    ``source.load_backbone``: no code from the checkpoint runs, and loading errors become a
    CheckpointError naming the source."""
    path, kwargs = resolve_model(source, model_kwargs)
    return load_backbone(path, causal_lm=causal_lm, **kwargs).eval()


def load_tokenizer(source: str | os.PathLike, model_kwargs: dict[str, Any] | None = None) -> Any:
    """The tokenizer stored with ``source`` (for GGUF: read from the GGUF file)."""
    path, kwargs = resolve_model(source, model_kwargs)
    tok_kwargs = {k: kwargs[k] for k in _TOKENIZER_KWARGS if k in kwargs}
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False, **tok_kwargs)
    except (OSError, ValueError, RuntimeError, TypeError, KeyError) as e:
        raise CheckpointError(f"cannot load a tokenizer from {path!r}: {e}") from None


def describe(source: Any) -> str:
    """A short name for reports: the path, or the model's ``name_or_path``."""
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    config = getattr(source, "config", None)
    name = getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "")
    return str(name) or type(source).__name__


def tokenizer_source(model: Any) -> str | None:
    """A local folder a tokenizer can be loaded from for an in-memory model, if known."""
    name = describe(model)
    return name if name and Path(name).is_dir() else None
