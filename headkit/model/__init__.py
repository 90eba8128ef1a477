"""``HeadedModel``: a backbone with named heads, its staged forward and generation."""

from .headed import HeadedModel, HeadedModelOutput

__all__ = ["HeadedModel", "HeadedModelOutput"]
