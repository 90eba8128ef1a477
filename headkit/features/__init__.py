"""Cached head inputs for frozen backbones: run the backbone once, train many probes on it.

``cache_features`` (``caching.py``) runs a frozen backbone over a dataset once and keeps what
each head reads (``features_given``: the same from pooled features already computed, such
as a probe sweep's); ``CachedFeatures`` (``storage.py``) holds it in memory or on disk;
``train_heads_on_features`` and ``predict_on_features`` (``train.py``) train and apply the
heads on it with the same loss computation as ``HeadedModel.forward``; under a process
group of several ranks ``shards.py`` splits the pass over them.
"""

from .caching import cache_features, features_given
from .storage import CachedFeatures
from .train import predict_on_features, train_heads_on_features

__all__ = [
    "CachedFeatures",
    "cache_features",
    "features_given",
    "predict_on_features",
    "train_heads_on_features",
]
