"""``build_dataset``: the dataset of any source, a folder, a list file or a prepared one (and ``open_folders``).

Data flows one way: the readers of folders and list files (``ssl_xcit.data.folders``) and of prepared datasets
(``ssl_xcit.data.shards``, ``ssl_xcit.data.shard_dataset``), both built on ``ssl_xcit.data.image_dataset``, are
below this module, and the data module above it. The names of those lower modules that callers use are
re-exported here, so ``from ssl_xcit.data.datasets import ImageDataset`` keeps working.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ssl_xcit.data.folders import IMG_EXTENSIONS, folder_dataset, is_image_file, read_list_file, scan_folder
from ssl_xcit.data.image_dataset import (
    EmptyBatch,
    ImageDataset,
    Sample,
    UnreadableImageWarning,
    collate_skip_none,
    collate_train,
    load_image,
)
from ssl_xcit.data.shard_dataset import ShardImageDataset
from ssl_xcit.data.shards import is_shard_root
from ssl_xcit.data.splits import stratified_split

__all__ = [
    "IMG_EXTENSIONS",
    "EmptyBatch",
    "ImageDataset",
    "Sample",
    "UnreadableImageWarning",
    "build_dataset",
    "collate_skip_none",
    "collate_train",
    "folder_dataset",
    "is_image_file",
    "load_image",
    "open_folders",
    "read_list_file",
    "scan_folder",
]


def build_dataset(
    root: str | Path, transform: Callable | None = None, labelled: bool | None = None
) -> ImageDataset:
    """An ImageDataset from an ImageFolder tree, any folder of images (recursive), a list file, or a dataset
    written by ``ssl-xcit prepare`` (a :class:`~ssl_xcit.data.shard_dataset.ShardImageDataset`).

    ``labelled``: ``None`` detects labels from the layout, ``False`` ignores them (label -1), ``True`` requires
    them. A missing root raises ``FileNotFoundError``; an empty or image-less one raises ``UserError``.
    """
    if is_shard_root(root):
        return ShardImageDataset(root, transform, labelled)
    return folder_dataset(root, transform, labelled)


def open_folders(
    train_root: str | Path,
    val_root: str | Path | None,
    val_fraction: float,
    labelled: bool | None,
    split_seed: int,
    transform: Callable | None,
) -> tuple[ImageDataset, ImageDataset | None]:
    """``(training set with transform, val set or None)`` of a folder or list file (as ``open_shards`` is for a
    prepared dataset): ``val_fraction > 0`` holds out that fraction of every class (stratified, by
    ``split_seed``; of all images when unlabelled, for the label-free monitor), else the val set is
    ``val_root``'s images, in any form ``build_dataset`` reads."""
    full = build_dataset(train_root, labelled=labelled)
    train_samples = full.samples
    val_set: ImageDataset | None = None
    if val_fraction > 0:
        # Unlabelled samples all carry -1: one "class", so the split is a seeded hold-out of all images.
        train_samples, held_out = stratified_split(full.samples, val_fraction, split_seed)
        val_set = ImageDataset(held_out, full.classes)
    elif val_root is not None:
        val_set = build_dataset(val_root)
    return ImageDataset(train_samples, full.classes, transform), val_set
