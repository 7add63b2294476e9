"""The linear probe's data: DINO's train augmentation, the eval transform, and the ImageFolder datamodule."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from ssl_xcit.evaluation.checks import check_not_empty, check_same_classes


def linear_train_transform(crop_size: int = 224):
    """DINO's linear-probe train augmentation: RandomResizedCrop (bilinear, scale 0.08-1) + flip + normalise."""
    from torchvision.transforms import v2

    from ssl_xcit.data.transforms import IMAGENET_MEAN, IMAGENET_STD

    return v2.Compose(
        [
            v2.ToImage(),
            v2.RandomResizedCrop(crop_size, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=list(IMAGENET_MEAN), std=list(IMAGENET_STD)),
        ]
    )


def _eval_transform(resize_size: int, crop_size: int):
    from ssl_xcit.data.transforms import eval_transform

    return eval_transform(resize=resize_size, crop=crop_size)


class LinearProbeDataModule(pl.LightningDataModule):
    """ImageFolder train/val trees (ImageNet's ``train/`` and ``val/`` class-folder layout works as is).

    Args:
        train: root of the labelled train images (one subfolder per class).
        val: root of the labelled validation images (the same class subfolders).
        batch_size: per device; the probe scales its lr by the total batch / 256.
        num_workers: data-loading processes per device.
        crop_size: training crop and validation centre crop (224 as in DINO).
        resize_size: validation resize before the centre crop (256 as in DINO, i.e. crop / 0.875).
    """

    def __init__(
        self,
        train: str,
        val: str,
        batch_size: int = 128,
        num_workers: int = 8,
        crop_size: int = 224,
        resize_size: int = 256,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_root, self.val_root = train, val
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.crop_size, self.resize_size = crop_size, resize_size
        self.train_dataset = self.val_dataset = None

    def _build(self) -> None:
        if self.train_dataset is not None:
            return
        from ssl_xcit.data.datasets import build_dataset

        self.train_dataset = build_dataset(self.train_root, transform=linear_train_transform(self.crop_size))
        self.val_dataset = build_dataset(
            self.val_root, transform=_eval_transform(self.resize_size, self.crop_size)
        )
        check_not_empty(self.train_dataset, "train", self.train_root)
        check_not_empty(self.val_dataset, "val", self.val_root)
        check_same_classes(self.train_dataset.classes, self.val_dataset.classes)

    def setup(self, stage: str | None = None) -> None:
        self._build()

    @property
    def num_classes(self) -> int:
        self._build()
        return len(self.train_dataset.classes)

    def _loader(self, dataset, shuffle: bool) -> DataLoader:
        from ssl_xcit.data.datasets import collate_skip_none

        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=False,
            num_workers=self.num_workers,
            collate_fn=collate_skip_none,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, shuffle=False)
