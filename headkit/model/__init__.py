"""``HeadedModel``: a backbone with named heads and its staged forward.

The names load on first use: ``generation/`` (which ``HeadedModel`` inherits from) imports
``model/head_inputs.py``, and importing this package must not import ``headed.py`` then.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["HeadedModel", "HeadedModelOutput"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(".headed", __name__), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from .headed import HeadedModel, HeadedModelOutput
