"""headkit: attach, train, save and load new heads on any Hugging Face transformer.

The public names are loaded on first use (``headkit.HeadedModel`` imports torch and
transformers then, not at ``import headkit``), so the command line's ``--help`` and tools that
only read a config start fast, and ``from headkit import *`` never imports the Trainer, peft,
datasets, scikit-learn or matplotlib.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Every public name -> the submodule (relative to ``headkit``) that defines it.
_LAZY: dict[str, str] = {
    "ACTIVATIONS": "heads.activations",
    "HEADS": "heads.base",
    "LOSSES": "losses.objective",
    "POOLINGS": "heads.pooling",
    "BatchError": "errors",
    "CachedFeatures": "features",
    "Calibration": "calibration",
    "CheckpointError": "errors",
    "ConfigError": "errors",
    "Head": "heads.base",
    "HeadConfig": "config",
    "HeadedCollator": "data.collator",
    "HeadedGenerateOutput": "model.generation",
    "HeadedModel": "model.headed",
    "HeadedModelOutput": "model.headed",
    "HeadedTrainer": "integrations.trainer",
    "HeadkitError": "errors",
    "HeadwiseMetrics": "metrics",
    "LossSpec": "losses.objective",
    "LossWeighting": "losses.weighting",
    "WEIGHTINGS": "losses.weighting",
    "MLPHead": "heads.mlp",
    "NonFiniteLossError": "errors",
    "PoolingStrategy": "heads.pooling",
    "ProbeResults": "probe.results",
    "ProbeRow": "probe.results",
    "SequencePooling": "heads.pooling",
    "cache_features": "features",
    "calibrate": "calibration",
    "create_headed_qlora": "integrations.peft",
    "evaluate_head_wise": "metrics",
    "export": "deploy",
    "get_model_params": "integrations.transformer_heads",
    "get_top_n_preds": "integrations.transformer_heads",
    "load_headed": "loading",
    "load_lora_with_heads": "integrations.peft",
    "merge_and_unload": "integrations.peft",
    "parse_layers": "probe.sweep",
    "predict_on_features": "features",
    "print_trainable_parameters": "integrations.transformer_heads",
    "probe_layers": "probe.sweep",
    "shard": "model.sharding",
    "to_sentence_transformer": "integrations.sentence_transformers",
    "train_heads_on_features": "features",
}

# What a user needs. Importable by name but not here: HeadedTrainer (importing it imports
# transformers.trainer, peft and datasets), SequencePooling and parse_layers (building blocks)
# and merge_and_unload (a copy of HeadedModel.merge_and_unload).
__all__ = [
    "ACTIVATIONS",
    "HEADS",
    "LOSSES",
    "POOLINGS",
    "WEIGHTINGS",
    "BatchError",
    "CachedFeatures",
    "Calibration",
    "CheckpointError",
    "ConfigError",
    "Head",
    "HeadConfig",
    "HeadedCollator",
    "HeadedGenerateOutput",
    "HeadedModel",
    "HeadedModelOutput",
    "HeadkitError",
    "HeadwiseMetrics",
    "LossSpec",
    "LossWeighting",
    "MLPHead",
    "NonFiniteLossError",
    "PoolingStrategy",
    "ProbeResults",
    "ProbeRow",
    "cache_features",
    "calibrate",
    "create_headed_qlora",
    "evaluate_head_wise",
    "export",
    "get_model_params",
    "get_top_n_preds",
    "load_headed",
    "load_lora_with_heads",
    "predict_on_features",
    "print_trainable_parameters",
    "probe_layers",
    "shard",
    "to_sentence_transformer",
    "train_heads_on_features",
]


def __getattr__(name: str) -> Any:
    """Import a public name's submodule on first use (and any submodule, ``headkit.config``)."""
    where = _LAZY.get(name)
    if where is not None:
        value = getattr(importlib.import_module(f".{where}", __name__), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


if TYPE_CHECKING:  # what type checkers and IDEs see (``X as X``: importable, not in __all__)
    from .calibration import Calibration, calibrate
    from .config import HeadConfig
    from .data.collator import HeadedCollator
    from .deploy import export
    from .errors import (
        BatchError,
        CheckpointError,
        ConfigError,
        HeadkitError,
        NonFiniteLossError,
    )
    from .features import (
        CachedFeatures,
        cache_features,
        predict_on_features,
        train_heads_on_features,
    )
    from .heads.activations import ACTIVATIONS
    from .heads.base import HEADS, Head
    from .heads.mlp import MLPHead
    from .heads.pooling import POOLINGS, PoolingStrategy
    from .heads.pooling import SequencePooling as SequencePooling
    from .integrations.peft import create_headed_qlora, load_lora_with_heads
    from .integrations.peft import merge_and_unload as merge_and_unload
    from .integrations.sentence_transformers import to_sentence_transformer
    from .integrations.trainer import HeadedTrainer as HeadedTrainer
    from .integrations.transformer_heads import (
        get_model_params,
        get_top_n_preds,
        print_trainable_parameters,
    )
    from .loading import load_headed
    from .losses.objective import LOSSES, LossSpec
    from .losses.weighting import WEIGHTINGS, LossWeighting
    from .metrics import HeadwiseMetrics, evaluate_head_wise
    from .model.generation import HeadedGenerateOutput
    from .model.headed import HeadedModel, HeadedModelOutput
    from .model.sharding import shard
    from .probe.results import ProbeResults, ProbeRow
    from .probe.sweep import parse_layers as parse_layers
    from .probe.sweep import probe_layers
