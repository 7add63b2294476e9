"""The DataLoader-worker half of DINO's multi-crop when the photometric half runs on the device.

:class:`MultiCropGeometry` does only what must happen per file: decode, the random resized crops, resize and
flip, and returns uint8 ``(3, H, W)`` tensors. The colour jitter, grayscale, blur, solarisation and
normalisation follow batched on the training device (``ssl_xcit.data.device_augment``).

Decoding only what is needed: the crop boxes are drawn first, from the image size in the file header, and a JPEG
is then decoded at the smallest DCT scale (1/2, 1/4 or 1/8, PIL's ``draft``) at which every crop of the image is
still at least as large as its output, so no crop is ever upsampled from a reduced decode. An 8 MP photo decodes
about 4x smaller per side at 2x224 + 8x96; 128-px flowers5 images and 640x480 photos decode at full size
because their 224-px crops already need every pixel. Crop and resize are one ``Image.resize(box=...)`` call, with
the box in the reduced image's (fractional) coordinates.

The crop boxes follow torchvision's ``RandomResizedCrop.get_params`` (same distribution, torch's RNG) and the
flip ``RandomHorizontalFlip``'s, so the geometry matches ``MultiCropTransform``'s. With ``gram_crops_size`` set
(Gram anchoring), two more crops follow the local ones: each global crop's box and flip at ``gram_crops_size``,
the Gram teacher's (no further draw).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from torchvision.transforms import RandomResizedCrop

from ssl_xcit.data.transforms import _check_probability, _check_scale, _check_size, _interpolation
from ssl_xcit.errors import UserError

_RATIO = (3.0 / 4.0, 4.0 / 3.0)
_PIL_RESAMPLE = {"nearest": Image.NEAREST, "bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}
# EXIF orientations 5..8 rotate by 90 degrees: the decoded image's width and height swap.
_TRANSPOSED_ORIENTATIONS = (5, 6, 7, 8)


def gram_crop_side(side: int, scale: float) -> int:
    """The Gram teacher's crop side for a global crop of ``side`` px: ``scale`` x ``side``, halves rounded up
    (DINOv3's high-resolution stage: 1.5 x 512 = 768, 1.5 x 768 = 1152)."""
    return math.floor(side * scale + 0.5)


@dataclass
class Crop:
    """One crop: box (top, left, height, width) in the full-size, upright image; output side; flip."""

    top: int
    left: int
    height: int
    width: int
    size: int
    flip: bool


@dataclass
class PlannedImage:
    """A decoded image with the crops drawn for it; ``scale`` maps full-size coordinates to the decoded ones."""

    image: Image.Image
    crops: list[Crop]
    scale: tuple[float, float]


class MultiCropGeometry:
    """Decode + random resized crops + flips -> ``[global_1, global_2, local_1, ...]`` uint8 (3, H, W) tensors.

    Args: the geometric arguments of ``MultiCropTransform`` (same defaults, ``gram_crops_size`` included), plus
    ``draft``: decode JPEGs at a reduced DCT scale when every crop allows it (off decodes every image at full size).
    """

    def __init__(
        self,
        global_crops_size: int = 224,
        global_crops_scale: tuple[float, float] = (0.4, 1.0),
        local_crops_number: int = 8,
        local_crops_size: int = 96,
        local_crops_scale: tuple[float, float] = (0.05, 0.4),
        flip_prob: float = 0.5,
        interpolation: str = "bicubic",
        draft: bool = True,
        gram_crops_size: int | None = None,
    ) -> None:
        if local_crops_number < 0 or int(local_crops_number) != local_crops_number:
            raise UserError(f"local_crops_number must be an integer >= 0, got {local_crops_number!r}")
        mode = _interpolation(interpolation).value
        if mode not in _PIL_RESAMPLE:
            raise UserError(f"unknown interpolation {interpolation!r}; valid: {sorted(_PIL_RESAMPLE)}")
        self.global_crops_size = _check_size("global_crops_size", global_crops_size)
        self.global_crops_scale = _check_scale("global_crops_scale", global_crops_scale)
        self.local_crops_number = int(local_crops_number)
        self.local_crops_size = _check_size("local_crops_size", local_crops_size)
        self.local_crops_scale = _check_scale("local_crops_scale", local_crops_scale)
        self.flip_prob = _check_probability("flip_prob", flip_prob)
        self.interpolation = mode
        self.resample = _PIL_RESAMPLE[mode]
        self.draft = bool(draft)
        self.gram_crops_size = (
            None if gram_crops_size is None else _check_size("gram_crops_size", gram_crops_size)
        )

    @property
    def num_crops(self) -> int:
        """DINO's crops per image (the Gram teacher's are :attr:`num_gram_crops` more)."""
        return 2 + self.local_crops_number

    @property
    def num_gram_crops(self) -> int:
        return 0 if self.gram_crops_size is None else 2

    def plan(self, width: int, height: int) -> list[Crop]:
        """Draw the crops of an upright ``width`` x ``height`` image (torch's RNG)."""
        # get_params only reads the image's shape: a zero-stride view costs no memory at any size.
        shape_only = torch.empty(1).expand(1, height, width)
        crops = []
        specs = [(self.global_crops_size, self.global_crops_scale)] * 2
        specs += [(self.local_crops_size, self.local_crops_scale)] * self.local_crops_number
        for size, scale in specs:
            top, left, h, w = RandomResizedCrop.get_params(shape_only, list(scale), list(_RATIO))
            flip = bool(torch.rand(1) < self.flip_prob)
            crops.append(Crop(top, left, h, w, size, flip))
        if self.gram_crops_size is not None:  # the global crops' boxes and flips at the Gram teacher's size
            crops += [Crop(c.top, c.left, c.height, c.width, self.gram_crops_size, c.flip) for c in crops[:2]]
        return crops

    def read(self, path: str | Path) -> PlannedImage:
        """Decode ``path`` (reduced when the crops allow it), upright and RGB, with its crops drawn."""
        with Image.open(path) as image:
            orientation = image.getexif().get(0x0112, 1)
            width, height = image.size
            if orientation in _TRANSPOSED_ORIENTATIONS:
                width, height = height, width
            crops = self.plan(width, height)
            if self.draft and image.format == "JPEG":
                # The largest reduction at which every crop keeps at least its output size.
                reduction = min(min(c.width, c.height) / c.size for c in crops)
                if reduction >= 2.0:
                    raw_w, raw_h = image.size
                    image.draft("RGB", (math.ceil(raw_w / reduction), math.ceil(raw_h / reduction)))
            image.load()  # the full decode, so a truncated file raises here
            # exif_transpose and convert each copy the image even when there is nothing to do: skip them then
            # (leaving the `with` closes only the file; the decoded pixels stay).
            upright = ImageOps.exif_transpose(image) if orientation != 1 else image
            if upright.mode != "RGB":
                upright = upright.convert("RGB")
        return PlannedImage(upright, crops, (upright.width / width, upright.height / height))

    def __call__(self, image: Image.Image | PlannedImage) -> list[torch.Tensor]:
        if isinstance(image, Image.Image):
            image = PlannedImage(image.convert("RGB"), self.plan(*image.size), (1.0, 1.0))
        sx, sy = image.scale
        out = []
        for c in image.crops:
            box = (c.left * sx, c.top * sy, (c.left + c.width) * sx, (c.top + c.height) * sy)
            crop = image.image.resize((c.size, c.size), self.resample, box=box)
            if c.flip:
                crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            out.append(torch.from_numpy(np.array(crop)).permute(2, 0, 1))
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(global_crops_size={self.global_crops_size}, "
            f"global_crops_scale={self.global_crops_scale}, local_crops_number={self.local_crops_number}, "
            f"local_crops_size={self.local_crops_size}, local_crops_scale={self.local_crops_scale}, "
            f"flip_prob={self.flip_prob}, interpolation={self.interpolation!r}, draft={self.draft}, "
            f"gram_crops_size={self.gram_crops_size})"
        )
