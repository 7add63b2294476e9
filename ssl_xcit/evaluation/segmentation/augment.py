"""DINOv2's training pipeline for the linear segmentation probe: its linear configs' mmsegmentation steps.

Per sample, in mmsegmentation's order (sizes are parameters; DINOv2's are short side 512, long side 2048, crop
512):

1. Resize by a ratio r ~ U(0.5, 2.0): the image is scaled to fit (long_side * r, short_side * r) keeping its
   aspect (mmcv's ``imrescale``: factor min(L r / long, S r / short), sides rounded half up), the image
   bilinearly, the mask by nearest neighbour.
2. Random crop of crop x crop (a side shorter than the crop is kept whole), redrawn up to 10 times until at
   least two classes are in it and none covers 75 % of its labelled pixels (``cat_max_ratio`` 0.75).
3. Horizontal flip with probability 0.5.
4. Photometric distortion on 0-255 values, clipped after each step, each step with probability 0.5: brightness
   + U(-32, 32); contrast x U(0.5, 1.5), either first or last (a coin); saturation: HSV S x U(0.5, 1.5);
   hue: H + an integer in [-18, 18] of OpenCV's 180 (a shift of at most a tenth of the circle).
5. ImageNet normalisation, then padding to crop x crop at the bottom and right: image 0, mask the ignore index.

Values stay float (mmcv rounds to uint8 after each photometric step); nothing else differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.transforms.v2 import functional as TF

from ssl_xcit.data.image_dataset import load_image
from ssl_xcit.data.transforms import IMAGENET_MEAN, IMAGENET_STD

__all__ = ["TrainCrops", "TrainPipeline", "photometric_distortion", "rescale_size", "to_float_image"]

_MEAN = torch.tensor(IMAGENET_MEAN).view(3, 1, 1) * 255
_STD = torch.tensor(IMAGENET_STD).view(3, 1, 1) * 255


def rescale_size(height: int, width: int, short_side: float, long_side: float) -> tuple[int, int]:
    """(height, width) scaled to fit ``long_side`` x ``short_side`` with the aspect kept (mmcv ``imrescale``)."""
    factor = min(long_side / max(height, width), short_side / min(height, width))
    return int(height * factor + 0.5), int(width * factor + 0.5)


def to_float_image(image) -> Tensor:
    """A PIL image as a (3, H, W) float32 tensor of 0-255 values."""
    return TF.pil_to_tensor(image.convert("RGB")).float()


def normalize(image: Tensor) -> Tensor:
    """0-255 values to ImageNet-normalised ones."""
    return (image - _MEAN) / _STD


def resize_pair(image: Tensor, mask: Tensor, size: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Image bilinear (half-pixel centres, no antialias: OpenCV's INTER_LINEAR), mask nearest."""
    if tuple(image.shape[-2:]) == tuple(size):
        return image, mask
    image = F.interpolate(image[None], size=size, mode="bilinear", align_corners=False)[0]
    mask = F.interpolate(mask[None, None].float(), size=size, mode="nearest")[0, 0].long()
    return image, mask


def _saturation(image: Tensor, factor: float) -> Tensor:
    # With hue and value fixed each channel is V - S * (V - c) / S_old, so scaling S scales V - c; the factor
    # is capped per pixel where S would pass 1 (the darkest channel at 0), as clipping S to 255 does.
    vmax, vmin = image.max(0, keepdim=True).values, image.min(0, keepdim=True).values
    spread = vmax - vmin
    limit = torch.where(spread > 0, vmax / spread.clamp(min=1e-12), torch.full_like(spread, float("inf")))
    return vmax - torch.clamp(limit, max=factor) * (vmax - image)


def _hue(image: Tensor, shift: int) -> Tensor:
    return TF.adjust_hue(image / 255, shift / 180) * 255


def photometric_distortion(image: Tensor, rng: np.random.Generator) -> Tensor:
    """mmsegmentation's ``PhotoMetricDistortion`` of a (3, H, W) 0-255 image (draws in its order)."""
    if rng.integers(2):
        image = (image + rng.uniform(-32, 32)).clamp(0, 255)
    contrast_first = bool(rng.integers(2))
    if contrast_first and rng.integers(2):
        image = (image * rng.uniform(0.5, 1.5)).clamp(0, 255)
    if rng.integers(2):
        image = _saturation(image, rng.uniform(0.5, 1.5)).clamp(0, 255)
    if rng.integers(2):
        image = _hue(image, int(rng.integers(-18, 19))).clamp(0, 255)
    if not contrast_first and rng.integers(2):
        image = (image * rng.uniform(0.5, 1.5)).clamp(0, 255)
    return image


def _crop_box(height: int, width: int, crop: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    top = int(rng.integers(0, max(height - crop, 0) + 1))
    left = int(rng.integers(0, max(width - crop, 0) + 1))
    return top, min(top + crop, height), left, min(left + crop, width)


@dataclass(frozen=True)
class TrainPipeline:
    """Steps 1-5 above for one (image, mask) pair; ``ratio_range`` (1, 1) and ``photometric=False`` turn off
    the scale jitter and the colour steps."""

    short_side: int = 512
    long_side: int = 2048
    crop: int = 512
    ignore_index: int = 255
    ratio_range: tuple[float, float] = (0.5, 2.0)
    cat_max_ratio: float = 0.75
    flip_prob: float = 0.5
    photometric: bool = True

    def __call__(self, image: Tensor, mask: Tensor, rng: np.random.Generator) -> tuple[Tensor, Tensor]:
        """(3, crop, crop) normalised image and (crop, crop) int64 mask from a 0-255 image and its mask."""
        low, high = self.ratio_range
        ratio = rng.random() * (high - low) + low
        size = rescale_size(*image.shape[-2:], self.short_side * ratio, self.long_side * ratio)
        image, mask = resize_pair(image, mask, size)
        box = _crop_box(*size, self.crop, rng)
        for _ in range(10):
            top, bottom, left, right = box
            ids, counts = torch.unique(mask[top:bottom, left:right], return_counts=True)
            counts = counts[ids != self.ignore_index]
            if len(counts) > 1 and counts.max() / counts.sum() < self.cat_max_ratio:
                break
            box = _crop_box(*size, self.crop, rng)
        top, bottom, left, right = box
        image, mask = image[:, top:bottom, left:right], mask[top:bottom, left:right]
        if rng.random() < self.flip_prob:
            image, mask = image.flip(-1), mask.flip(-1)
        if self.photometric:
            image = photometric_distortion(image, rng)
        pad = (0, self.crop - image.shape[-1], 0, self.crop - image.shape[-2])
        return F.pad(normalize(image), pad, value=0.0), F.pad(mask, pad, value=self.ignore_index)


class TrainCrops(Dataset):
    """``length`` augmented samples: item k is image ``order[k]`` through the pipeline with a generator seeded
    by (seed, k), so a run is the same whatever the number of loader workers. ``order`` is a run of seeded
    permutations of the split, as mmsegmentation's infinite sampler draws."""

    def __init__(
        self,
        images: Sequence[Path],
        masks: Sequence[Tensor],
        pipeline: TrainPipeline,
        length: int,
        seed: int,
    ) -> None:
        self.images, self.masks, self.pipeline, self.seed = list(images), list(masks), pipeline, seed
        generator = torch.Generator().manual_seed(seed)
        rounds = -(-length // len(self.images))
        self.order = torch.cat([torch.randperm(len(self.images), generator=generator) for _ in range(rounds)])
        self.order = self.order[:length].tolist()

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, k: int) -> tuple[Tensor, Tensor]:
        index = self.order[k]
        image = to_float_image(load_image(self.images[index], exif_transpose=False))
        return self.pipeline(image, self.masks[index], np.random.default_rng([self.seed, k]))
