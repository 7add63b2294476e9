"""Data: DINO multi-crop transforms, image datasets, deterministic splits, the built-in synthetic set, and the
Lightning data module that ties them together."""

from __future__ import annotations

from ssl_xcit.data.datasets import (
    IMG_EXTENSIONS,
    EmptyBatch,
    ImageDataset,
    UnreadableImageWarning,
    build_dataset,
    collate_skip_none,
    collate_train,
)
from ssl_xcit.data.splits import stratified_split
from ssl_xcit.data.synthetic import ensure_synthetic_dataset
from ssl_xcit.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    MultiCropTransform,
    describe_transform,
    eval_transform,
)


def __getattr__(name: str):
    # The data module pulls in Lightning; importing it lazily keeps `ssl_xcit.data.transforms` etc. light.
    if name in ("DINODataModule", "SkippedImagesLogger"):
        from ssl_xcit.data import datamodule

        return getattr(datamodule, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMG_EXTENSIONS",
    "DINODataModule",
    "ImageDataset",
    "MultiCropTransform",
    "SkippedImagesLogger",
    "UnreadableImageWarning",
    "build_dataset",
    "EmptyBatch",
    "collate_skip_none",
    "collate_train",
    "describe_transform",
    "ensure_synthetic_dataset",
    "eval_transform",
    "stratified_split",
]
