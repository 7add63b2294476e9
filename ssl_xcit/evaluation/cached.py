"""Features of a dataset through the on-disk cache: look up the key, extract only on a miss, store the result.

The backbone is built only on a cache miss, so a re-run with the same inputs touches neither the model nor the
images. Extraction itself is :mod:`ssl_xcit.evaluation.features`, the key :mod:`ssl_xcit.evaluation.keys`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ssl_xcit.errors import UserError
from ssl_xcit.evaluation import cache as feature_cache
from ssl_xcit.evaluation.backbone import build_eval_backbone
from ssl_xcit.evaluation.checks import check_not_empty
from ssl_xcit.evaluation.features import FeatureConfig, FeatureExtractor, run_extraction
from ssl_xcit.evaluation.keys import feature_meta

log = logging.getLogger(__name__)

__all__ = ["dataset_features", "split_features"]

_CLS = FeatureConfig()  # the default feature: the final CLS embedding


def dataset_features(
    dataset: Any,
    split: str,
    *,
    weights: str | os.PathLike | None,
    arch: str | None,
    config: FeatureConfig = _CLS,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    seed: int = 0,
    model: nn.Module | Callable[[], nn.Module] | None = None,
    batch_size: int = 128,
    num_workers: int = 4,
    accelerator: str = "auto",
    devices: int | str | list[int] = "auto",
    precision: str | int | None = None,
    progress: bool = True,
    extractor_hook: Callable[[FeatureExtractor], None] | None = None,
) -> tuple[dict[str, torch.Tensor], bool]:
    """Features of ``dataset`` (cached per split): returns ``(tensors, cache_hit)``.

    ``model`` skips building the backbone here, so callers evaluating train and val share one. A module is
    keyed on its own class, structure and tensors (``weights``, ``arch`` and ``seed`` then play no part); a
    zero-argument factory is called only on a cache miss, so the key is ``weights``, ``arch`` and ``seed``,
    which it must build. A missing weights file raises ``FileNotFoundError`` naming it before anything else
    runs.
    """
    check_not_empty(dataset, split, getattr(dataset, "root", None))
    module = model if isinstance(model, nn.Module) else None
    meta = feature_meta(
        dataset, weights=weights, arch=arch, config=config, seed=seed, precision=precision, model=module
    )
    cache_dir = Path(cache_dir) if cache_dir is not None else feature_cache.default_cache_dir()
    if use_cache:
        cached = feature_cache.load_cached(cache_dir, split, meta)
        if cached is not None:
            log.info("feature cache hit for %s: %s", split, feature_cache.cache_path(cache_dir, split, meta))
            return cached, True
    if model is None:
        model = build_eval_backbone(weights, arch, seed)
    elif not isinstance(model, nn.Module):
        model = model()
    result, is_zero = run_extraction(
        model,
        dataset,
        config=config,
        batch_size=batch_size,
        num_workers=num_workers,
        accelerator=accelerator,
        devices=devices,
        precision=precision,
        progress=progress,
        extractor_hook=extractor_hook,
    )
    if result["features"].shape[0] == 0:
        raise UserError(f"the {split} split has no readable images: all {len(dataset)} files failed to load")
    if use_cache and is_zero:
        feature_cache.save_cached(cache_dir, split, meta, result)
    return result, False


def split_features(
    train_ds: Any,
    val_ds: Any,
    *,
    weights: str | os.PathLike | None,
    arch: str | None,
    config: FeatureConfig,
    seed: int = 0,
    **extract: Any,
) -> tuple[tuple[dict[str, torch.Tensor], bool], tuple[dict[str, torch.Tensor], bool], nn.Module | None]:
    """Features of a train and a val split through the cache: ``((train, hit), (val, hit), backbone)``.

    The two splits share one backbone, built only if one of them misses the cache (``backbone`` is None when
    both hit). ``extract`` takes the other keyword arguments of :func:`dataset_features` (cache_dir, ...).
    """
    backbone: list[nn.Module] = []

    def shared_backbone() -> nn.Module:
        if not backbone:
            backbone.append(build_eval_backbone(weights, arch, seed))
        return backbone[0]

    common = dict(weights=weights, arch=arch, config=config, seed=seed, model=shared_backbone, **extract)
    train = dataset_features(train_ds, "train", **common)
    val = dataset_features(val_ds, "val", **common)
    return train, val, (backbone[0] if backbone else None)
