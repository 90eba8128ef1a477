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
    "EXPORTERS": "formats",
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
    "HeadedGenerateOutput": "generation.generate",
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
    "SlowHeadsWarning": "model.rates",
    "SequencePooling": "heads.pooling",
    "cache_features": "features",
    "calibrate": "calibration",
    "create_headed_qlora": "compat.calls",
    "evaluate_head_wise": "metrics",
    "export": "deploy",
    "get_model_params": "compat.helpers",
    "get_top_n_preds": "compat.helpers",
    "load_headed": "compat.calls",
    "load_lora_with_heads": "compat.calls",
    "merge_and_unload": "integrations.peft",
    "param_groups": "model.rates",
    "parse_layers": "probe.sweep",
    "predict_on_features": "features",
    "print_trainable_parameters": "compat.helpers",
    "probe_layers": "probe.sweep",
    "shard": "distributed.sharding",
    "to_sentence_transformer": "integrations.sentence_transformers",
    "train_heads_on_features": "features",
    "PreferenceCollator": "data.preferences",
    "preference_labels": "losses.pairwise",
    "step_scores": "data.stepwise",
    "step_end_scores": "data.stepwise",
}

#: Importable by name but left out of ``__all__``: HeadedTrainer (importing it imports
#: transformers.trainer, peft and datasets), SequencePooling and parse_layers (building
#: blocks), merge_and_unload (a copy of HeadedModel.merge_and_unload) and EXPORTERS (an
#: extension point, like ``headkit.formats.READERS``).
_BY_NAME_ONLY = frozenset(
    {"EXPORTERS", "HeadedTrainer", "SequencePooling", "merge_and_unload", "parse_layers"}
)
#: What a user needs: every public name but those above (``_LAZY`` is the one list).
__all__ = sorted(n for n in _LAZY if n not in _BY_NAME_ONLY)


def _register_edges() -> None:
    """Wire the edge packages into the core's registries by name (nothing is imported: each
    is imported the first time its entry is asked for). This package is where core and edges
    meet; the core itself never names an edge."""
    from .formats import EXPORTERS, IGNORE_PADS_ALIASES, READERS

    READERS.register_lazy("transformer-heads", "headkit.compat.checkpoint:READER")
    # transformer-heads' token-loss rule (its name, stored configs use it): headkit's value
    IGNORE_PADS_ALIASES.register("transformer-heads", "drop_last_real")
    EXPORTERS.register_lazy("onnx", "headkit.integrations.onnx:export_onnx")
    EXPORTERS.register_lazy(
        "transformers", "headkit.integrations.hf_classifiers:export_transformers"
    )
    EXPORTERS.register_lazy(
        "sentence-transformers",
        "headkit.integrations.sentence_transformers:export_sentence_transformer",
    )
    EXPORTERS.register_lazy("hub", "headkit.checkpoint.hub:export_to_hub")


_register_edges()


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


if TYPE_CHECKING:  # what type checkers and IDEs see (``X as X``: the lazy names, re-exported)
    from .calibration import Calibration as Calibration
    from .calibration import calibrate as calibrate
    from .compat.calls import create_headed_qlora as create_headed_qlora
    from .compat.calls import load_headed as load_headed
    from .compat.calls import load_lora_with_heads as load_lora_with_heads
    from .compat.helpers import get_model_params as get_model_params
    from .compat.helpers import get_top_n_preds as get_top_n_preds
    from .compat.helpers import print_trainable_parameters as print_trainable_parameters
    from .config import HeadConfig as HeadConfig
    from .data.collator import HeadedCollator as HeadedCollator
    from .data.preferences import PreferenceCollator as PreferenceCollator
    from .data.stepwise import step_end_scores as step_end_scores
    from .data.stepwise import step_scores as step_scores
    from .deploy import export as export
    from .distributed.sharding import shard as shard
    from .errors import BatchError as BatchError
    from .errors import CheckpointError as CheckpointError
    from .errors import ConfigError as ConfigError
    from .errors import HeadkitError as HeadkitError
    from .errors import NonFiniteLossError as NonFiniteLossError
    from .features import CachedFeatures as CachedFeatures
    from .features import cache_features as cache_features
    from .features import predict_on_features as predict_on_features
    from .features import train_heads_on_features as train_heads_on_features
    from .formats import EXPORTERS as EXPORTERS
    from .generation.generate import HeadedGenerateOutput as HeadedGenerateOutput
    from .heads.activations import ACTIVATIONS as ACTIVATIONS
    from .heads.base import HEADS as HEADS
    from .heads.base import Head as Head
    from .heads.mlp import MLPHead as MLPHead
    from .heads.pooling import POOLINGS as POOLINGS
    from .heads.pooling import PoolingStrategy as PoolingStrategy
    from .heads.pooling import SequencePooling as SequencePooling
    from .integrations.peft import merge_and_unload as merge_and_unload
    from .integrations.sentence_transformers import (
        to_sentence_transformer as to_sentence_transformer,
    )
    from .integrations.trainer import HeadedTrainer as HeadedTrainer
    from .losses.objective import LOSSES as LOSSES
    from .losses.objective import LossSpec as LossSpec
    from .losses.pairwise import preference_labels as preference_labels
    from .losses.weighting import WEIGHTINGS as WEIGHTINGS
    from .losses.weighting import LossWeighting as LossWeighting
    from .metrics import HeadwiseMetrics as HeadwiseMetrics
    from .metrics import evaluate_head_wise as evaluate_head_wise
    from .model.headed import HeadedModel as HeadedModel
    from .model.headed import HeadedModelOutput as HeadedModelOutput
    from .model.rates import SlowHeadsWarning as SlowHeadsWarning
    from .model.rates import param_groups as param_groups
    from .probe.results import ProbeResults as ProbeResults
    from .probe.results import ProbeRow as ProbeRow
    from .probe.sweep import parse_layers as parse_layers
    from .probe.sweep import probe_layers as probe_layers
