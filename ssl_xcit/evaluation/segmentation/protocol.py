"""DINOv2's linear segmentation protocol: the head trained on augmented crops through the frozen backbone for a
fixed number of iterations, then scored with sliding windows.

Training reads the backbone's final-norm tokens of each augmented crop (:mod:`.augment`) on every iteration
(no cache: every crop is new), with ``batch_size`` crops per iteration (DINOv2: 16, 2 on each of 8 GPUs) for
``iters`` iterations (40,000). Inference resizes each val image as the test pipeline does (short side to
``short_side``, the long side at most ``long_side``), slides ``crop`` windows every ``stride`` pixels over it
(:mod:`.slide`; each window padded evenly to the patch multiple, as DINOv2 pads its inputs, and its logits
resized back to the window), averages overlapping windows, resizes the logits bilinearly to the mask's own size
and takes the arg-max there.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from ssl_xcit.data.image_dataset import load_image
from ssl_xcit.evaluation.segmentation.augment import (
    TrainCrops,
    TrainPipeline,
    normalize,
    rescale_size,
    resize_pair,
    to_float_image,
)
from ssl_xcit.evaluation.segmentation.data import SegmentationSplit
from ssl_xcit.evaluation.segmentation.features import dense_tokens
from ssl_xcit.evaluation.segmentation.probe import DEFAULT_LR, SegmentationProbe
from ssl_xcit.evaluation.segmentation.slide import center_pad, slide_logits

__all__ = ["CropProbe", "TestImages", "protocol_predictions", "train_and_predict_crops"]


class TestImages(Dataset):
    """Val images at the test scale, normalised: ``(image (3, h, w), dataset index)``."""

    def __init__(self, images: list[Path], short_side: int, long_side: int) -> None:
        self.images, self.short_side, self.long_side = images, short_side, long_side

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        image = to_float_image(load_image(self.images[index], exif_transpose=False))
        size = rescale_size(*image.shape[-2:], self.short_side, self.long_side)
        image, _ = resize_pair(image, torch.zeros(image.shape[-2:], dtype=torch.long), size)
        return normalize(image), index


class CropProbe(SegmentationProbe):
    """The head with the frozen backbone in front: trains on (crops, masks) batches, predicts by sliding
    windows. Only the head's BatchNorm and linear layer learn; the backbone stays in eval mode."""

    def __init__(
        self,
        backbone: nn.Module,
        dim: int,
        num_classes: int,
        ignore_index: int,
        *,
        layers: int = 1,
        crop: int = 512,
        stride: int = 341,
        lr: float = DEFAULT_LR,
    ) -> None:
        super().__init__(dim, num_classes, ignore_index, lr=lr)
        self.backbone = backbone.eval().requires_grad_(False)
        self.layers, self.crop, self.stride = layers, crop, stride
        self.mask_sizes: dict[int, tuple[int, int]] = {}

    def train(self, mode: bool = True) -> CropProbe:
        super().train(mode)
        self.backbone.eval()  # frozen: no dropout, no drop path, whatever Lightning switches
        return self

    def logits(self, images: Tensor) -> Tensor:
        """Class logits (B, K, H, W) of equally sized images, at their size."""
        with torch.no_grad():
            padded = center_pad(images, int(self.backbone.size_multiple))
            tokens, grid = dense_tokens(self.backbone, padded, self.layers)
        logits = self.grid_logits(tokens, grid)
        return F.interpolate(logits, size=images.shape[-2:], mode="bilinear", align_corners=False)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        images, masks = batch
        pixel_losses = F.cross_entropy(
            self.logits(images), masks, ignore_index=self.ignore_index, reduction="none"
        )
        loss = (
            pixel_losses.mean()
        )  # over every pixel, ignored and padded ones adding 0 (avg_non_ignore=False)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(masks))
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> list[tuple[int, Tensor]]:
        """Per image: its dataset index and predicted class ids at its mask's size (``mask_sizes``)."""
        out = []
        for image, index in zip(*batch, strict=True):
            logits = slide_logits(self.logits, image, self.classifier.out_features, self.crop, self.stride)
            size = self.mask_sizes[int(index)]
            logits = F.interpolate(logits[None], size=size, mode="bilinear", align_corners=False)[0]
            out.append((int(index), logits.argmax(0).cpu()))
        return out


def _lists(batch: list[tuple[Tensor, int]]) -> tuple[list[Tensor], list[int]]:
    return [item[0] for item in batch], [item[1] for item in batch]


def train_and_predict_crops(
    probe: CropProbe,
    train: TrainCrops,
    test: TestImages,
    mask_sizes: list[tuple[int, int]],
    *,
    batch_size: int,
    num_workers: int,
    accelerator: str,
    precision: str | None,
    progress: bool,
) -> dict[int, Tensor]:
    """Fit the head for ``len(train) // batch_size`` iterations; its predicted class ids per val image."""
    workers = {"num_workers": num_workers, "persistent_workers": False}
    loader = DataLoader(train, batch_size=batch_size, shuffle=False, drop_last=True, **workers)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator=accelerator,
        devices=1,
        precision=precision or "32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=progress,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode", category=UserWarning)
        trainer.fit(probe, train_dataloaders=loader)  # the frozen backbone is in eval mode on purpose
    probe.mask_sizes = {i: tuple(int(v) for v in size) for i, size in enumerate(mask_sizes)}
    batches = trainer.predict(probe, dataloaders=DataLoader(test, batch_size=1, collate_fn=_lists, **workers))
    return dict(item for batch in batches or [] for item in batch)


def protocol_predictions(
    backbone: nn.Module,
    train_split: SegmentationSplit,
    val_split: SegmentationSplit,
    num_classes: int,
    ignore_index: int,
    *,
    layers: int,
    iters: int,
    short_side: int,
    crop: int,
    stride: int,
    lr: float,
    batch_size: int,
    seed: int,
    num_workers: int,
    accelerator: str,
    precision: str | None,
    progress: bool,
) -> tuple[dict[int, Tensor], int, str]:
    """The whole protocol: predicted class ids per val image (by index), the token width, the transforms."""
    pl.seed_everything(seed, verbose=False)
    with torch.no_grad():
        blank = center_pad(torch.zeros(1, 3, crop, crop), int(backbone.size_multiple))
        dim = int(dense_tokens(backbone, blank, layers)[0].shape[-1])
    probe = CropProbe(
        backbone, dim, num_classes, ignore_index, layers=layers, crop=crop, stride=stride, lr=lr
    )
    pipeline = TrainPipeline(
        short_side=short_side, long_side=4 * short_side, crop=crop, ignore_index=ignore_index
    )
    crops = TrainCrops(train_split.images, train_split.masks, pipeline, iters * batch_size, seed)
    predicted = train_and_predict_crops(
        probe,
        crops,
        TestImages(val_split.images, short_side, 4 * short_side),
        [tuple(m.shape) for m in val_split.masks],
        batch_size=batch_size,
        num_workers=num_workers,
        accelerator=accelerator,
        precision=precision,
        progress=progress,
    )
    test = f"test: short side {short_side} (long at most {4 * short_side}), windows {crop} every {stride}"
    return predicted, dim, f"train: {pipeline}; {test}"
