"""Batches for a HeadedModel: the collator and text/word encoding."""

from .collator import HeadedCollator

__all__ = ["HeadedCollator"]
