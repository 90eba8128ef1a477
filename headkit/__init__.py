"""headkit: attach, train, save and load new heads on any Hugging Face transformer."""

from .activations import ACTIVATIONS
from .compat import get_model_params, get_top_n_preds, print_trainable_parameters
from .config import HeadConfig
from .data import HeadedCollator
from .errors import BatchError, CheckpointError, ConfigError, HeadkitError, NonFiniteLossError
from .features import (
    CachedFeatures,
    cache_features,
    predict_on_features,
    train_heads_on_features,
)
from .generation import HeadedGenerateOutput
from .heads import HEADS, Head, MLPHead
from .loading import load_headed
from .lora import create_headed_qlora, load_lora_with_heads, merge_and_unload
from .losses import LOSSES, LossSpec
from .metrics import HeadwiseMetrics, evaluate_head_wise
from .model import HeadedModel, HeadedModelOutput
from .pooling import POOLINGS, PoolingStrategy, SequencePooling
from .st import to_sentence_transformer
from .weighting import LossWeighting

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
    "SequencePooling",
    "cache_features",
    "create_headed_qlora",
    "evaluate_head_wise",
    "get_model_params",
    "get_top_n_preds",
    "load_headed",
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
        from .training import HeadedTrainer

        return HeadedTrainer
    raise AttributeError(f"module 'headkit' has no attribute {name!r}")
