"""``run_segment``: the linear segmentation probe end to end: read and check the data, train the head (DINOv2's
protocol on augmented crops, or ``fast`` on cached whole-image tokens), score the val split."""

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
    reduce_zero_label,
)
from ssl_xcit.evaluation.segmentation.features import DenseFeature, split_dense_features
from ssl_xcit.evaluation.segmentation.metrics import ConfusionMatrix, scores_from_confusion
from ssl_xcit.evaluation.segmentation.probe import DEFAULT_LR, SegmentationProbe, TokenMasks, collate_tokens
from ssl_xcit.evaluation.segmentation.protocol import protocol_predictions

__all__ = ["DEFAULT_EPOCHS", "DEFAULT_ITERS", "format_segment_table", "run_segment", "write_predictions"]

DEFAULT_EPOCHS = 40  # --fast only
DEFAULT_ITERS = 40_000  # DINOv2's linear configs
DEFAULT_SHORT_SIDE, DEFAULT_CROP, DEFAULT_STRIDE = 512, 512, 341  # and the long side at most 4 x the short


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
    budget = f"{results['epochs']} epochs, fast" if results["fast"] else f"{results['iters']} iterations"
    lines = [
        f"linear segmentation probe ({results['feature']}, {budget}, {results['num_train']} "
        f"train / {results['num_val']} val, {results['num_classes']} classes)",
        f"mIoU {results['miou'] if results['miou'] is not None else float('nan'):.2f}   "
        f"pixel accuracy {results['pixel_acc']:.2f}",
        f"{'class':>16} {'IoU':>7}",
    ]
    for name, iou in results["per_class_iou"].items():
        lines.append(f"{name:>16} {'-' if iou is None else f'{iou:.2f}':>7}")
    return "\n".join(lines)


def _read_data(
    train: str | os.PathLike,
    val: str | os.PathLike,
    ignore_index: int,
    num_classes: int | None,
    reduce_zero: bool = False,
) -> tuple[SegmentationSplit, SegmentationSplit, int, list[str]]:
    """Both splits, read (``reduce_zero``: id 0 ignored, the others minus 1) and checked, the number of
    classes and their names."""
    if ignore_index < 0:
        raise UserError(f"--ignore-index must be >= 0 (a mask value), got {ignore_index}")
    train_split, val_split = read_split(train, "train"), read_split(val, "val")
    if reduce_zero:
        for split in (train_split, val_split):
            split.masks = [reduce_zero_label(m, ignore_index) for m in split.masks]
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


def _check_budget(fast: bool, epochs: int | None, iters: int, sizes: dict[str, int | None]) -> None:
    if not fast and epochs is not None:
        raise UserError(
            f"--epochs {epochs} counts passes of --fast's cached tokens; the default protocol counts --iters "
            f"(DINOv2: {DEFAULT_ITERS})"
        )
    for name, value in (("--epochs", epochs), ("--iters", iters), *sizes.items()):
        if value is not None and value < 1:
            raise UserError(f"{name} must be at least 1, got {value}")


def _fast_predictions(backbone, feature, train_split, val_split, num_classes, ignore_index, *, short_side,
                      epochs, lr, batch_size, seed, accelerator, progress, extract) -> tuple[dict, int, str, dict]:  # fmt: skip
    """``--fast``: the head on cached tokens of whole images; predictions by index, token width, transform and
    the cache hits per split."""
    transform = dense_transform(int(backbone.size_multiple), short_side)
    datasets = {
        "train": SegmentationImages(train_split.images, transform),
        "val": SegmentationImages(val_split.images, transform),
    }
    features = split_dense_features(datasets, backbone, feature=feature, seed=seed, batch_size=batch_size,
                                    accelerator=accelerator, progress=progress, **extract)  # fmt: skip
    (train_feats, _), (val_feats, _) = features["train"], features["val"]
    pl.seed_everything(seed, verbose=False)
    dim = int(train_feats["tokens"].shape[1])
    predicted = _train_and_predict(
        TokenMasks(train_feats, train_split.masks),
        TokenMasks(val_feats, val_split.masks),
        SegmentationProbe(dim, num_classes, ignore_index, lr=lr),
        epochs=epochs,
        batch_size=batch_size,
        seed=seed,
        accelerator=accelerator,
        progress=progress,
    )
    return predicted, dim, repr(transform), {split: hit for split, (_, hit) in features.items()}


def run_segment(
    train: str | os.PathLike,
    val: str | os.PathLike,
    *,
    weights: str | None = None,
    arch: str | None = None,
    layers: int = 1,
    fast: bool = False,
    iters: int = DEFAULT_ITERS,
    epochs: int | None = None,
    short_side: int | None = None,
    crop_size: int = DEFAULT_CROP,
    stride: int = DEFAULT_STRIDE,
    reduce_zero_label: bool = False,
    ignore_index: int = 255,
    num_classes: int | None = None,
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
    """Train the probe on ``train``, score it on ``val``; returns (and writes) the results.

    Default: DINOv2's protocol (:mod:`.protocol`): ``iters`` iterations of ``batch_size`` augmented
    ``crop_size`` crops of images scaled around ``short_side`` (512), sliding windows at test time. ``fast``:
    the head on cached tokens of whole images (``short_side`` None: their own size) for ``epochs`` (40).
    ``model`` probes that module (any object with ``size_multiple`` and ``get_dense_layers``, e.g. a backbone
    with its depth cut) instead of ``weights``/``arch``; its cache key is its own fingerprint."""
    feature = DenseFeature(layers)
    sizes = {
        "--batch-size": batch_size,
        "--short-side": short_side,
        "--crop-size": crop_size,
        "--stride": stride,
    }
    _check_budget(fast, epochs, iters, sizes)
    epochs = DEFAULT_EPOCHS if epochs is None else epochs
    train_split, val_split, num_classes, names = _read_data(
        train, val, ignore_index, num_classes, reduce_zero_label
    )
    backbone = model.eval() if model is not None else build_eval_backbone(weights, arch, seed)
    if fast:
        extract = dict(weights=weights, arch=arch, cache_dir=cache_dir, use_cache=use_cache,
                       precision=precision, num_workers=num_workers, key_on_module=model is not None)  # fmt: skip
        predicted, dim, transform, hits = _fast_predictions(
            backbone, feature, train_split, val_split, num_classes, ignore_index, short_side=short_side,
            epochs=epochs, lr=lr, batch_size=batch_size, seed=seed, accelerator=accelerator, progress=progress,
            extract=extract,
        )  # fmt: skip
    else:
        predicted, dim, transform = protocol_predictions(
            backbone, train_split, val_split, num_classes, ignore_index, layers=layers, iters=iters,
            short_side=short_side or DEFAULT_SHORT_SIDE, crop=crop_size, stride=stride, lr=lr,
            batch_size=batch_size, seed=seed, num_workers=num_workers, accelerator=accelerator,
            precision=precision, progress=progress,
        )  # fmt: skip
        hits = None  # every crop is new: nothing is cached

    confusion = ConfusionMatrix(num_classes, ignore_index)
    order = sorted(predicted)
    for i in order:
        confusion.update(predicted[i], val_split.masks[i])
    scores = scores_from_confusion(confusion.compute())
    if predictions is not None:
        write_predictions(predictions, [val_split.stems[i] for i in order], [predicted[i] for i in order])

    results = {
        "protocol": "linear segmentation (DINOv2)" + (", fast: cached whole-image tokens" if fast else ""),
        "weights": weights,
        "arch": arch or getattr(backbone, "name", None),
        "feature": feature.name,
        "feature_dim": dim,
        "fast": fast,
        "iters": None if fast else iters,
        "epochs": epochs if fast else None,
        "short_side": short_side,
        "crop_size": None if fast else crop_size,
        "stride": None if fast else stride,
        "reduce_zero_label": reduce_zero_label,
        "transform": transform,
        "num_classes": num_classes,
        "ignore_index": ignore_index,
        "classes": names,
        "miou": _nan_to_none(float(scores["miou"])),
        "pixel_acc": float(scores["pixel_acc"]),
        "per_class_iou": {n: _nan_to_none(v) for n, v in zip(names, scores["iou"], strict=True)},
        "lr": lr,
        "batch_size": batch_size,
        "num_train": len(train_split.images),
        "num_val": len(val_split.images),
        "feature_cache_hit": hits,
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
