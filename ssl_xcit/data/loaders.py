"""The DataLoaders of ``DINODataModule``: training batches from a loader Lightning checkpoints (LitData's for a
prepared dataset, ``ssl_xcit.data.resumable``'s for files), validation batches from a plain one, in order."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from ssl_xcit.data.datasets import ImageDataset, collate_skip_none, collate_train
from ssl_xcit.data.device_crops import CropReader, collate_crops
from ssl_xcit.data.resumable import BatchPairs, resumable_loader, run_seed
from ssl_xcit.data.streaming import ShardTrainSet, shard_train_loader
from ssl_xcit.errors import UserError


def build_loader(
    dataset: ImageDataset,
    batch_size: int,
    train: bool,
    trainer: Any,
    *,
    num_workers: int,
    pin_memory: bool,
    persistent_workers: bool,
    batch_pairs: BatchPairs | None = None,
) -> DataLoader:
    """The loader of ``dataset``: shuffled, ``drop_last`` and resumable mid-epoch when ``train``, else in order.

    ``trainer`` (or None) gives the rank, world size and epoch; ``pin_memory`` applies only where CUDA is
    available. A dataset whose transform is a :class:`CropReader` collates into ``CropBatch`` es. ``batch_pairs``:
    the training keys are ``(index, pair)`` (``ssl_xcit.data.stages.MixedCropsView``; files only).
    """
    shards = isinstance(dataset, ShardTrainSet)
    device_crops = isinstance(dataset.item_transform if shards else dataset.transform, CropReader)
    common = dict(
        num_workers=num_workers,
        pin_memory=pin_memory and torch.cuda.is_available(),
        persistent_workers=persistent_workers,
    )
    collate = collate_crops if device_crops else collate_train
    if train and shards:  # LitData's loader, checkpointed by Lightning too (ssl_xcit.data.streaming)
        return shard_train_loader(
            dataset,
            batch_size,
            collate,
            rank=trainer.global_rank if trainer is not None else 0,
            seed=run_seed(),
            epoch=(lambda: trainer.fit_loop.epoch_progress.current.processed)
            if trainer is not None
            else None,
            **common,
        )
    if train:  # checkpointed by Lightning and resumed mid-epoch exactly (ssl_xcit.data.resumable)
        return resumable_loader(
            dataset,
            batch_size,
            collate,
            world_size=trainer.world_size if trainer is not None else 1,
            rank=trainer.global_rank if trainer is not None else 0,
            batch_pairs=batch_pairs,
            **common,
        )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=pin_memory and torch.cuda.is_available(),
        persistent_workers=persistent_workers and num_workers > 0,
        collate_fn=collate_crops if device_crops else collate_skip_none,
    )


def check_full_batches(dataset: Any, batch_size: int, world_size: int, root: Any) -> None:
    """Refuse a training set with fewer images per rank than ``batch_size``: ``drop_last`` would leave no batch."""
    total = getattr(dataset, "num_records", None) or len(dataset)
    per_rank = total // max(world_size, 1)
    if per_rank < batch_size:
        raise UserError(
            f"{root} has {total} training images ({per_rank} per device on {world_size}), "
            f"fewer than batch_size={batch_size}: with drop_last no full batch would be left; "
            "lower data.batch_size"
        )
