"""``run_segment``: the linear segmentation probe end to end (read, extract through the cache, train, score)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn as nn
from PIL import Image
from torch.utils.data import DataLoader

from ssl_xcit.errors import UserError
from ssl_xcit.evaluation.backbone import build_eval_backbone
from ssl_xcit.evaluation.segmentation.data import (
    VOC_CLASSES,
    SegmentationImages,
    SegmentationSplit,
    check_ids,
    dense_transform,
    infer_num_classes,
    read_split,
)
from ssl_xcit.evaluation.segmentation.features import DenseFeature, split_dense_features
from ssl_xcit.evaluation.segmentation.metrics import ConfusionMatrix, scores_from_confusion
from ssl_xcit.evaluation.segmentation.probe import DEFAULT_LR, SegmentationProbe, TokenMasks, collate_tokens

__all__ = ["DEFAULT_EPOCHS", "format_segment_table", "run_segment", "write_predictions"]

DEFAULT_EPOCHS = 40


def _nan_to_none(value: float) -> float | None:
    return None if math.isnan(value) else value


def write_predictions(folder: str | os.PathLike, stems: list[str], predictions: list[torch.Tensor]) -> None:
    """One PNG of class ids per image, ``<stem>.png`` (8-bit grey, 16-bit past 255 classes)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for stem, pred in zip(stems, predictions, strict=True):
        array = pred.numpy()
        array = array.astype(np.uint8) if array.max(initial=0) < 256 else array.astype(np.uint16)
        Image.fromarray(array).save(folder / f"{stem}.png")


def format_segment_table(results: dict[str, Any]) -> str:
    """mIoU and pixel accuracy, then the IoU of each class (``-`` for a class in neither truth nor prediction)."""
    lines = [
        f"linear segmentation probe ({results['feature']}, {results['epochs']} epochs, {results['num_train']} "
        f"train / {results['num_val']} val, {results['num_classes']} classes)",
        f"mIoU {results['miou'] if results['miou'] is not None else float('nan'):.2f}   "
        f"pixel accuracy {results['pixel_acc']:.2f}",
        f"{'class':>16} {'IoU':>7}",
    ]
    for name, iou in results["per_class_iou"].items():
        lines.append(f"{name:>16} {'-' if iou is None else f'{iou:.2f}':>7}")
    return "\n".join(lines)


def _read_data(
    train: str | os.PathLike, val: str | os.PathLike, ignore_index: int, num_classes: int | None
) -> tuple[SegmentationSplit, SegmentationSplit, int, list[str]]:
    """Both splits, read and checked, the number of classes and their names."""
    if ignore_index < 0:
        raise UserError(f"--ignore-index must be >= 0 (a mask value), got {ignore_index}")
    train_split, val_split = read_split(train, "train"), read_split(val, "val")
    if num_classes is None:
        num_classes = infer_num_classes([train_split, val_split], ignore_index)
    if num_classes < 2 or ignore_index < num_classes:
        raise UserError(
            f"{num_classes} classes with ignore index {ignore_index}: the probe needs at least 2 classes, and "
            "the ignore index must not be a class id (>= the number of classes)"
        )
    check_ids(train_split, "train", num_classes, ignore_index)
    check_ids(val_split, "val", num_classes, ignore_index)
    voc_names = val_split.voc and num_classes == len(VOC_CLASSES)
    names = list(VOC_CLASSES) if voc_names else [str(i) for i in range(num_classes)]
    return train_split, val_split, num_classes, names


def _train_and_predict(
    train_data: TokenMasks,
    val_data: TokenMasks,
    probe: SegmentationProbe,
    *,
    epochs: int,
    batch_size: int,
    seed: int,
    accelerator: str,
    progress: bool,
) -> dict[int, torch.Tensor]:
    """Fit the head on the train tokens; its predicted class ids per val image, by dataset index."""
    loader = DataLoader(
        train_data,
        batch_size=batch_size,
        shuffle=True,
        collate_fn=collate_tokens,
        generator=torch.Generator().manual_seed(seed),
    )
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator=accelerator,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=progress,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(probe, train_dataloaders=loader)
    val_loader = DataLoader(val_data, batch_size=batch_size, collate_fn=collate_tokens)
    batches = trainer.predict(probe, dataloaders=val_loader)
    return dict(item for batch in batches or [] for item in batch)


def run_segment(
    train: str | os.PathLike,
    val: str | os.PathLike,
    *,
    weights: str | None = None,
    arch: str | None = None,
    layers: int = 1,
    short_side: int | None = None,
    ignore_index: int = 255,
    num_classes: int | None = None,
    epochs: int = DEFAULT_EPOCHS,
    lr: float = DEFAULT_LR,
    batch_size: int = 16,
    num_workers: int = 4,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    accelerator: str = "auto",
    precision: str | None = None,
    seed: int = 0,
    progress: bool = True,
    output: str | os.PathLike | None = None,
    predictions: str | os.PathLike | None = None,
    model: nn.Module | None = None,
) -> dict[str, Any]:
    """Train the probe on ``train``'s cached patch tokens, score it on ``val``; returns (and writes) results.

    ``model`` probes that module (any object with ``size_multiple`` and ``forward_patch_tokens``, e.g. a
    backbone with its depth cut) instead of ``weights``/``arch``; its cache key is its own fingerprint."""
    feature = DenseFeature(layers)
    for name, value in (("--epochs", epochs), ("--batch-size", batch_size)):
        if value < 1:
            raise UserError(f"{name} must be at least 1, got {value}")
    train_split, val_split, num_classes, names = _read_data(train, val, ignore_index, num_classes)

    backbone = model.eval() if model is not None else build_eval_backbone(weights, arch, seed)
    transform = dense_transform(int(backbone.size_multiple), short_side)
    datasets = {
        "train": SegmentationImages(train_split.images, transform),
        "val": SegmentationImages(val_split.images, transform),
    }
    features = split_dense_features(
        datasets,
        backbone,
        weights=weights,
        arch=arch,
        feature=feature,
        seed=seed,
        cache_dir=cache_dir,
        use_cache=use_cache,
        precision=precision,
        batch_size=batch_size,
        num_workers=num_workers,
        accelerator=accelerator,
        progress=progress,
        key_on_module=model is not None,
    )
    (train_feats, train_hit), (val_feats, val_hit) = features["train"], features["val"]
    train_data = TokenMasks(train_feats, train_split.masks)
    val_data = TokenMasks(val_feats, val_split.masks)

    pl.seed_everything(seed, verbose=False)
    dim = int(train_feats["tokens"].shape[1])
    probe = SegmentationProbe(dim, num_classes, ignore_index, lr=lr)
    predicted = _train_and_predict(
        train_data,
        val_data,
        probe,
        epochs=epochs,
        batch_size=batch_size,
        seed=seed,
        accelerator=accelerator,
        progress=progress,
    )

    confusion = ConfusionMatrix(num_classes, ignore_index)
    order = sorted(predicted)
    for i in order:
        confusion.update(predicted[i], val_split.masks[i])
    scores = scores_from_confusion(confusion.compute())
    if predictions is not None:
        write_predictions(predictions, [val_split.stems[i] for i in order], [predicted[i] for i in order])

    results = {
        "protocol": "linear segmentation (DINOv2)",
        "weights": weights,
        "arch": arch or getattr(backbone, "name", None),
        "feature": feature.name,
        "feature_dim": dim,
        "short_side": short_side,
        "transform": repr(transform),
        "num_classes": num_classes,
        "ignore_index": ignore_index,
        "classes": names,
        "miou": _nan_to_none(float(scores["miou"])),
        "pixel_acc": float(scores["pixel_acc"]),
        "per_class_iou": {n: _nan_to_none(v) for n, v in zip(names, scores["iou"], strict=True)},
        "epochs": epochs,
        "lr": lr,
        "batch_size": batch_size,
        "num_train": len(train_data),
        "num_val": len(val_data),
        "feature_cache_hit": {"train": train_hit, "val": val_hit},
        "train": str(train),
        "val": str(val),
        "seed": seed,
        "predictions": str(predictions) if predictions is not None else None,
    }
    print(format_segment_table(results))
    if output:
        from ssl_xcit.utils.io import atomic_write_json

        atomic_write_json(results, output)
    return results
