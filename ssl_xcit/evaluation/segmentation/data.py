"""Segmentation data: image/mask pairs in an ``images/`` + ``masks/`` folder pair or the Pascal VOC layout.

- ``DIR/images/NAME.jpg`` (any image type) with ``DIR/masks/NAME.png``: one class id per pixel (8-bit or 16-bit
  grey, or a palette PNG, whose indices are the ids), the ignore value marking unlabelled pixels.
- The VOC layout: ``DIR/JPEGImages/``, ``DIR/SegmentationClass/`` (palette PNGs, 255 = border/ignore) and
  ``DIR/ImageSets/Segmentation/{train,val}.txt``; the list read is the split's (``--train`` reads train.txt).

Every mask is read once, in the main process, and checked before any feature is extracted: its size must be its
image's, and its ids below the number of classes (or the ignore value).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import v2

from ssl_xcit.data.folders import IMG_EXTENSIONS
from ssl_xcit.data.image_dataset import load_image
from ssl_xcit.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from ssl_xcit.errors import UserError

__all__ = [
    "VOC_CLASSES",
    "PatchMultipleResize",
    "SegmentationImages",
    "SegmentationSplit",
    "dense_transform",
    "find_pairs",
    "read_split",
    "reduce_zero_label",
]

VOC_CLASSES = (
    "background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor",
)  # fmt: skip
_MASK_MODES = ("L", "P", "I", "I;16")


def _listing(names: list[str], limit: int = 3) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _voc_pairs(root: Path, split: str) -> list[tuple[Path, Path]]:
    listing = root / "ImageSets" / "Segmentation" / f"{split}.txt"
    if not listing.is_file():
        raise UserError(
            f"VOC layout {root}: the split list {listing} is missing (expected train.txt and val.txt)"
        )
    names = [line.strip() for line in listing.read_text().splitlines() if line.strip()]
    pairs = [(root / "JPEGImages" / f"{n}.jpg", root / "SegmentationClass" / f"{n}.png") for n in names]
    missing = [str(p) for pair in pairs for p in pair if not p.is_file()]
    if missing:
        raise UserError(f"{listing} names {len(missing)} files that are missing: {_listing(missing)}")
    return pairs


def _folder_pairs(root: Path) -> list[tuple[Path, Path]]:
    images_dir, masks_dir = root / "images", root / "masks"
    for folder in (images_dir, masks_dir):
        if not folder.is_dir():
            raise UserError(
                f"segmentation data {root}: no {folder.name}/ folder; expected images/ + masks/ (NAME.png class "
                "ids per image) or the VOC layout (JPEGImages/, SegmentationClass/, ImageSets/Segmentation/)"
            )
    images = {p.stem: p for p in sorted(images_dir.iterdir()) if p.suffix.lower() in IMG_EXTENSIONS}
    masks = {p.stem: p for p in sorted(masks_dir.iterdir()) if p.suffix.lower() == ".png"}
    no_mask, no_image = sorted(images.keys() - masks.keys()), sorted(masks.keys() - images.keys())
    if no_mask or no_image:
        parts = [f"{len(no_mask)} images without a mask ({_listing(no_mask)})"] if no_mask else []
        parts += [f"{len(no_image)} masks without an image ({_listing(no_image)})"] if no_image else []
        raise UserError(f"{root}: image and mask names differ: {'; '.join(parts)}")
    if not images:
        raise UserError(f"{images_dir} holds no images ({', '.join(IMG_EXTENSIONS)})")
    return [(images[name], masks[name]) for name in sorted(images)]


def find_pairs(root: str | os.PathLike, split: str) -> tuple[list[tuple[Path, Path]], bool]:
    """``(image, mask)`` paths of a split sorted by name, and whether ``root`` is in the VOC layout."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"segmentation data folder not found: {root}")
    if (root / "JPEGImages").is_dir() and (root / "SegmentationClass").is_dir():
        return _voc_pairs(root, split), True
    return _folder_pairs(root), False


def read_mask(path: Path, image_size: tuple[int, int]) -> torch.Tensor:
    """The (H, W) int64 class ids of a mask, checked against its image's (width, height)."""
    with Image.open(path) as mask:
        if mask.mode not in _MASK_MODES:
            raise UserError(
                f"mask {path} is a {mask.mode} image; a mask holds one class id per pixel (grey or palette PNG)"
            )
        if mask.size != image_size:
            raise UserError(
                f"mask {path} is {mask.size[0]}x{mask.size[1]} but its image is {image_size[0]}x{image_size[1]}"
            )
        return torch.from_numpy(np.asarray(mask).astype(np.int64))


@dataclass
class SegmentationSplit:
    """One split: image paths, their masks (int64 class ids), whether it is VOC-laid-out."""

    images: list[Path]
    masks: list[torch.Tensor]
    voc: bool

    @property
    def stems(self) -> list[str]:
        return [p.stem for p in self.images]


def read_split(root: str | os.PathLike, split: str) -> SegmentationSplit:
    """Every image path and mask of a split (masks decoded now, images later by the feature extractor)."""
    pairs, voc = find_pairs(root, split)
    masks = []
    for image, mask in pairs:
        with Image.open(image) as im:  # the header only: the size, without decoding
            size = im.size
        masks.append(read_mask(mask, size))
    return SegmentationSplit([i for i, _ in pairs], masks, voc)


def reduce_zero_label(mask: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """mmsegmentation's ``reduce_zero_label`` (ADE20K, whose id 0 is "other"): 0 becomes the ignore index, the
    ignore index stays, every other id drops by one."""
    ignored = (mask == 0) | (mask == ignore_index)
    return torch.where(ignored, torch.full_like(mask, ignore_index), mask - 1)


def check_ids(split: SegmentationSplit, name: str, num_classes: int, ignore_index: int) -> None:
    """A UserError naming the first mask with an id that is neither a class (< num_classes) nor ignored."""
    for image, mask in zip(split.images, split.masks, strict=True):
        ids = torch.unique(mask)
        bad = ids[(ids >= num_classes) & (ids != ignore_index)]
        if bad.numel():
            raise UserError(
                f"{name} mask of {image.name} holds class ids {bad.tolist()[:5]}, but there are {num_classes} "
                f"classes (ids 0..{num_classes - 1}) and the ignore index is {ignore_index}; set "
                "--num-classes or --ignore-index"
            )


def infer_num_classes(splits: list[SegmentationSplit], ignore_index: int) -> int:
    """1 + the largest id in the masks of ``splits``, the ignore value aside."""
    labelled = [m[m != ignore_index] for split in splits for m in split.masks]
    top = max((int(ids.max()) for ids in labelled if ids.numel()), default=-1)
    if top < 0:
        raise UserError(f"every pixel of every mask is the ignore index {ignore_index}: nothing to learn")
    return top + 1


def feature_size(height: int, width: int, multiple: int, short_side: int | None = None) -> tuple[int, int]:
    """The input size of an image: scaled so its short side is ``short_side`` (kept as is when None), then each
    side rounded to the nearest multiple of ``multiple``, halves up (at least one)."""
    scale = 1.0 if short_side is None else short_side / min(height, width)
    sides = (max(1, math.floor(side * scale / multiple + 0.5)) * multiple for side in (height, width))
    return tuple(sides)  # type: ignore[return-value]


class PatchMultipleResize:
    """Resize a PIL image to :func:`feature_size` (bilinear, antialiased): whole images at about their own
    resolution, as DINOv2 evaluates dense features, with sides the backbone accepts."""

    def __init__(self, multiple: int, short_side: int | None = None) -> None:
        if multiple < 1 or (short_side is not None and short_side < 1):
            raise UserError(f"size multiple {multiple} and short side {short_side} must be positive")
        self.multiple, self.short_side = multiple, short_side

    def __call__(self, image: Image.Image) -> Image.Image:
        height, width = feature_size(image.height, image.width, self.multiple, self.short_side)
        return v2.functional.resize(image, [height, width], interpolation=v2.InterpolationMode.BILINEAR)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(multiple={self.multiple}, short_side={self.short_side})"


def dense_transform(multiple: int, short_side: int | None = None) -> v2.Compose:
    """Whole-image eval transform: :class:`PatchMultipleResize`, then tensor, ImageNet normalisation."""
    return v2.Compose(
        [
            PatchMultipleResize(multiple, short_side),
            v2.PILToTensor(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=list(IMAGENET_MEAN), std=list(IMAGENET_STD)),
        ]
    )


class SegmentationImages(Dataset):
    """The images of a split, for the feature extractor: ``(tensor, 0, index)`` per image.

    Decoded without the EXIF rotation, since masks are drawn on the stored pixel grid. ``samples`` is
    ``(path, 0)`` per image, the form the feature cache keys on."""

    def __init__(self, images: list[Path], transform: v2.Compose) -> None:
        self.samples = [(Path(p), 0) for p in images]
        self.transform = transform
        self.classes: list[str] = []

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        image = load_image(self.samples[index][0], exif_transpose=False)
        return self.transform(image), 0, index
