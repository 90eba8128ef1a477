"""Error types. Every error headkit raises for bad input is a ``ValueError`` subclass."""

from __future__ import annotations

from typing import Any


class HeadkitError(ValueError):
    """Base class of headkit's input errors (a ``ValueError``).

    ``field`` names the config field or argument the error is about (``"num_layers"``,
    ``"format"``) and ``value`` the offending value, where the raise site knows them; both are
    optional keywords, so ``ConfigError("message")`` alone stays valid. The command line maps
    ``field`` to its option names.
    """

    def __init__(self, *args: Any, field: str | None = None, value: Any = None) -> None:
        super().__init__(*args)
        self.field = field
        self.value = value


class ConfigError(HeadkitError):
    """A HeadConfig, or a combination of configs and backbone, is invalid."""


class BatchError(HeadkitError):
    """A batch (inputs or labels) does not fit the model's heads."""


class CheckpointError(HeadkitError):
    """A checkpoint directory is missing, corrupt, or of an unsupported format."""


class NonFiniteLossError(HeadkitError):
    """A head produced a NaN or infinite loss."""
