"""headkit: attach, train, save and load new heads on any Hugging Face transformer."""

from .config import HeadConfig
from .data.collator import HeadedCollator
from .errors import BatchError, CheckpointError, ConfigError, HeadkitError, NonFiniteLossError
from .features import (
    CachedFeatures,
    cache_features,
    predict_on_features,
    train_heads_on_features,
)
from .heads.activations import ACTIVATIONS
from .heads.base import HEADS, Head
from .heads.mlp import MLPHead
from .heads.pooling import POOLINGS, PoolingStrategy, SequencePooling
from .integrations.peft import create_headed_qlora, load_lora_with_heads, merge_and_unload
from .integrations.sentence_transformers import to_sentence_transformer
from .integrations.transformer_heads import (
    get_model_params,
    get_top_n_preds,
    print_trainable_parameters,
)
from .loading import load_headed
from .losses.objective import LOSSES, LossSpec
from .losses.weighting import LossWeighting
from .metrics import HeadwiseMetrics, evaluate_head_wise
from .model.generation import HeadedGenerateOutput
from .model.headed import HeadedModel, HeadedModelOutput
from .probe.results import ProbeResults, ProbeRow
from .probe.sweep import parse_layers, probe_layers

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS",
    "HEADS",
    "LOSSES",
    "POOLINGS",
    "BatchError",
    "CachedFeatures",
    "CheckpointError",
    "ConfigError",
    "Head",
    "HeadConfig",
    "HeadedCollator",
    "HeadedGenerateOutput",
    "HeadedModel",
    "HeadedModelOutput",
    "HeadedTrainer",
    "HeadkitError",
    "HeadwiseMetrics",
    "LossSpec",
    "LossWeighting",
    "MLPHead",
    "NonFiniteLossError",
    "PoolingStrategy",
    "ProbeResults",
    "ProbeRow",
    "SequencePooling",
    "cache_features",
    "create_headed_qlora",
    "evaluate_head_wise",
    "get_model_params",
    "get_top_n_preds",
    "load_headed",
    "parse_layers",
    "probe_layers",
    "load_lora_with_heads",
    "merge_and_unload",
    "predict_on_features",
    "print_trainable_parameters",
    "to_sentence_transformer",
    "train_heads_on_features",
]


def __getattr__(name: str):
    # HeadedTrainer imports transformers.Trainer (slow, needs accelerate): load it on first use.
    if name == "HeadedTrainer":
        from .integrations.trainer import HeadedTrainer

        return HeadedTrainer
    raise AttributeError(f"module 'headkit' has no attribute {name!r}")
