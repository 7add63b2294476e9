"""The feature cache key: everything the features of a dataset depend on.

The key is the weights (the checkpoint's sha256 and the model name, or the class, structure and tensors of a
module passed in), the transform's full ``repr``, the feature type, a fingerprint of the file list (paths,
sizes, mtimes, labels), the precision, the extraction version, the versions of torch, torchvision, Pillow and
timm, the source of our decoding and resizing code and a fingerprint of the model code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch.nn as nn

from ssl_xcit.data.transforms import describe_transform
from ssl_xcit.evaluation import cache as feature_cache

if TYPE_CHECKING:  # features.py imports Lightning; the key needs only the config's name
    from ssl_xcit.evaluation.features import FeatureConfig

__all__ = ["EXTRACTION_VERSION", "input_code_fingerprint", "feature_meta"]

# Bumped when extraction outside the model code changes meaning (batching, feature assembly, collate), so
# cached features of an older version are not reused; model-code changes are caught by code_fingerprint().
EXTRACTION_VERSION = "knn-v1: compute_features cast to float32, corrupt images dropped, dataset order kept"


# Packages whose code is keyed by version (feature_cache.library_versions), not by source.
_LIBRARIES = ("PIL", "timm", "torch", "torchvision")


def _transform_parts(transform: Any) -> list[Any]:
    """``transform`` and, recursively, the transforms it chains (``Compose.transforms`` and the like)."""
    parts, todo = [], [transform]
    while todo:
        part = todo.pop(0)
        if part is None:
            continue
        parts.append(part)
        inner = getattr(part, "transforms", None)
        if isinstance(inner, (list, tuple)):
            todo.extend(inner)
    return parts


def input_code_fingerprint(dataset: Any) -> str:
    """Source fingerprint of our code between an image file and the model input: the dataset class (its
    ``__getitem__`` picks the reader), the reader it calls (the transform's own ``read``, else
    ``ssl_xcit.data.image_dataset.load_image``) and every transform class outside the libraries (whose code is
    keyed by their versions)."""
    from ssl_xcit.data import image_dataset

    transform = getattr(dataset, "transform", None)
    reader = getattr(dataset, "decoder", None) or getattr(transform, "read", None) or image_dataset.load_image
    ours = [
        type(part)
        for part in _transform_parts(transform)
        if type(part).__module__.split(".")[0] not in _LIBRARIES
    ]
    return feature_cache.source_fingerprint(type(dataset), reader, *ours)


def feature_meta(
    dataset: Any,
    *,
    weights: str | os.PathLike | None,
    arch: str | None,
    config: FeatureConfig,
    seed: int = 0,
    precision: str | int | None = None,
    extra: Mapping[str, Any] | None = None,
    model: nn.Module | None = None,
) -> dict[str, Any]:
    """The cache key: everything the features depend on.

    With a ``model`` the key holds its :func:`~ssl_xcit.evaluation.cache.module_fingerprint` and ignores
    ``weights``, ``arch`` and ``seed``: the module given is what computes the features.
    """
    samples = getattr(dataset, "samples", None)
    if samples is None:
        raise TypeError("dataset_features needs a dataset with a .samples list of (path, label)")
    from_file = model is None
    meta = {
        "checkpoint_sha256": feature_cache.checkpoint_fingerprint(weights) if from_file else None,
        "arch": (arch or "inferred-from-checkpoint") if from_file else None,
        "init_seed": seed if from_file and weights is None else None,
        "module": None if from_file else feature_cache.module_fingerprint(model),
        "libraries": feature_cache.library_versions(),
        "input_code": input_code_fingerprint(dataset),
        "transform": describe_transform(getattr(dataset, "transform", None)),
        "classes": list(getattr(dataset, "classes", None) or []),
        # A prepared dataset's sample paths are not files here: it keys itself (ShardImageDataset).
        "files": dataset.files_fingerprint()
        if hasattr(dataset, "files_fingerprint")
        else feature_cache.files_fingerprint([p for p, _ in samples], [int(y) for _, y in samples]),
        "num_files": len(samples),
        "feature": config.name,
        "precision": feature_cache.precision_key(precision),
        "extraction": EXTRACTION_VERSION,
        "code": feature_cache.code_fingerprint(),
    }
    meta.update(extra or {})
    return meta
