"""Frozen-feature evaluation: weighted k-NN (DINO protocol), linear probe, and the feature cache they share.

Importing this package loads neither Lightning nor faiss: ``knn`` imports torch and numpy (faiss only for
``backend="faiss"``), ``cache`` torch and timm (timm's version is part of every cache key). ``features`` and
``linear`` pull in Lightning and are imported on use (``from ssl_xcit.evaluation.features import
extract_features``).
"""

from __future__ import annotations

from ssl_xcit.evaluation.cache import load_cached, save_cached
from ssl_xcit.evaluation.knn import DEFAULT_KS, DEFAULT_TEMPERATURE, knn_accuracy, weighted_knn

__all__ = ["DEFAULT_KS", "DEFAULT_TEMPERATURE", "knn_accuracy", "weighted_knn", "load_cached", "save_cached"]
