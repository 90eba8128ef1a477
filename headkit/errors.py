"""Error types. Every error headkit raises for bad input is a ``ValueError`` subclass."""

from __future__ import annotations


class HeadkitError(ValueError):
    """Base class of headkit's input errors (a ``ValueError``)."""


class ConfigError(HeadkitError):
    """A HeadConfig, or a combination of configs and backbone, is invalid."""


class BatchError(HeadkitError):
    """A batch (inputs or labels) does not fit the model's heads."""


class CheckpointError(HeadkitError):
    """A checkpoint directory is missing, corrupt, or of an unsupported format."""


class NonFiniteLossError(HeadkitError):
    """A head produced a NaN or infinite loss."""
