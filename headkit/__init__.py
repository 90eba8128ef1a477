"""headkit: attach, train, save and load new heads on any Hugging Face transformer."""

from .activations import ACTIVATIONS
from .config import HeadConfig
from .errors import BatchError, CheckpointError, ConfigError, HeadkitError, NonFiniteLossError
from .heads import MLPHead
from .loading import load_headed
from .losses import LOSSES, LossSpec
from .model import HeadedModel, HeadedModelOutput
from .pooling import POOLINGS, SequencePooling

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS",
    "LOSSES",
    "POOLINGS",
    "BatchError",
    "CheckpointError",
    "ConfigError",
    "HeadConfig",
    "HeadedModel",
    "HeadedModelOutput",
    "HeadkitError",
    "LossSpec",
    "MLPHead",
    "NonFiniteLossError",
    "SequencePooling",
    "load_headed",
]
