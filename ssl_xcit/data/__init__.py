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
    # Both pull in Lightning; importing them lazily keeps `ssl_xcit.data.transforms` etc. light.
    if name == "DINODataModule":
        from ssl_xcit.data.datamodule import DINODataModule

        return DINODataModule
    if name == "SkippedImagesLogger":
        from ssl_xcit.data.callbacks import SkippedImagesLogger

        return SkippedImagesLogger
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
