"""Frozen-feature evaluation: weighted k-NN (DINO protocol), linear probe, linear segmentation probe
(``segmentation``, DINOv2's dense protocol), and the feature cache they share.

Importing this package loads neither Lightning nor faiss: ``knn`` imports torch and numpy (faiss only for
``backend="faiss"``), ``cache`` torch and timm (timm's version is part of every cache key). ``features``
(extraction), ``cached`` (extraction through the cache), ``linear`` and ``segmentation`` pull in Lightning and are imported on
use (``from ssl_xcit.evaluation.features import extract_features``); ``keys`` (the cache key), ``checks``
(dataset checks) and ``backbone`` (the frozen backbone) do not.
"""

from __future__ import annotations

from ssl_xcit.evaluation.cache import load_cached, save_cached
from ssl_xcit.evaluation.knn import DEFAULT_KS, DEFAULT_TEMPERATURE, knn_accuracy, weighted_knn

__all__ = ["DEFAULT_KS", "DEFAULT_TEMPERATURE", "knn_accuracy", "weighted_knn", "load_cached", "save_cached"]
