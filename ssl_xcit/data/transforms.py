"""DINO's multi-crop augmentation and the evaluation transform, on torchvision transforms v2.

``MultiCropTransform`` reproduces ``main_dino.py:DataAugmentationDINO``: two global crops and N local crops, each
with flip, colour jitter, grayscale and Gaussian blur; solarisation on the second global crop only; ImageNet
normalisation. One difference on purpose: every random draw comes from torch's RNG (the v2 transforms and our blur
use ``torch.rand``), so ``torch.manual_seed`` (and Lightning's per-worker seeding) makes it reproducible. The
reference drew the blur and solarize coins from Python's ``random``, which ``utils.fix_random_seeds`` never
seeded, so its runs were not reproducible.

With ``gram_crops_size`` set (Gram anchoring, ``ssl_xcit.dino.gram``), each global crop also gives the Gram teacher a
crop of its own, as DINOv3's ``DataAugmentationDINO`` with ``gram_teacher_no_distortions``: the same box and the
same flip resampled (bicubic by default, anti-aliased) to ``gram_crops_size``, then only normalised. DINOv3 cuts the
box once at the Gram size and resizes that to the global size; here both are resampled from the image itself, so
the global crop is not resampled twice. The random draws are the same with or without it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image, ImageFilter
from torchvision.transforms import RandomResizedCrop as _V1RandomResizedCrop
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from ssl_xcit.errors import UserError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_INTERPOLATIONS = {
    "nearest": v2.InterpolationMode.NEAREST,
    "bilinear": v2.InterpolationMode.BILINEAR,
    "bicubic": v2.InterpolationMode.BICUBIC,
}


def _interpolation(mode: str | v2.InterpolationMode) -> v2.InterpolationMode:
    if isinstance(mode, v2.InterpolationMode):
        return mode
    try:
        return _INTERPOLATIONS[str(mode).lower()]
    except KeyError:
        raise UserError(f"unknown interpolation {mode!r}; valid: {sorted(_INTERPOLATIONS)}") from None


def _check_probability(name: str, p: float) -> float:
    if not 0.0 <= float(p) <= 1.0:
        raise UserError(f"{name} must be a probability in [0, 1], got {p!r}")
    return float(p)


def _check_scale(name: str, scale: Sequence[float]) -> tuple[float, float]:
    if len(scale) != 2 or not 0.0 < scale[0] <= scale[1] <= 1.0:
        raise UserError(f"{name} must be (min, max) with 0 < min <= max <= 1, got {tuple(scale)!r}")
    return float(scale[0]), float(scale[1])


def _check_size(name: str, size: int) -> int:
    if int(size) != size or size < 1:
        raise UserError(f"{name} must be a positive integer, got {size!r}")
    return int(size)


class GaussianBlur(v2.Transform):
    """Gaussian blur with a standard deviation drawn uniformly from ``radius`` (torch RNG).

    DINO blurred PIL images with ``ImageFilter.GaussianBlur(radius)``, where Pillow's ``radius`` IS the standard
    deviation (Pillow docs), so sigma = radius with no conversion. PIL images are blurred with that very filter:
    it runs extended box filters whose cost does not grow with sigma, unlike the dense 13x13 convolution of
    ``v2.GaussianBlur(13, ...)`` (``benchmarks/bench_dataloading.py --compare-blur``; docs/benchmarks.md). Tensors go through ``v2.functional.gaussian_blur``
    with an odd kernel of ``2 * ceil(3 sigma) + 1`` taps: +-3 sigma keeps 99.7 % of the Gaussian's mass, so the
    truncation is invisible on 8-bit images, and a kernel sized per draw keeps small blurs cheap.
    """

    def __init__(self, radius: Sequence[float] = (0.1, 2.0)) -> None:
        super().__init__()
        if len(radius) != 2 or not 0.0 < radius[0] <= radius[1]:
            raise UserError(f"blur radius must be (min, max) with 0 < min <= max, got {tuple(radius)!r}")
        self.radius = (float(radius[0]), float(radius[1]))

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        return {"sigma": float(torch.empty(1).uniform_(self.radius[0], self.radius[1]).item())}

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        sigma = params["sigma"]
        if isinstance(inpt, Image.Image):
            return inpt.filter(ImageFilter.GaussianBlur(sigma))
        # Reflection padding needs the half-width below the image side, so tiny images get a shorter kernel.
        half = min(math.ceil(3.0 * sigma), min(inpt.shape[-2:]) - 1)
        return F.gaussian_blur(inpt, kernel_size=[2 * half + 1] * 2, sigma=[sigma, sigma])

    def extra_repr(self) -> str:
        return f"radius={self.radius}"


def _crop_pipeline(
    size: int | None,
    scale: tuple[float, float],
    blur_prob: float,
    solarize_prob: float,
    *,
    flip_prob: float,
    color_jitter: tuple[float, float, float, float],
    color_jitter_prob: float,
    grayscale_prob: float,
    blur_radius: tuple[float, float],
    solarize_threshold: int,
    interpolation: v2.InterpolationMode,
    mean: Sequence[float],
    std: Sequence[float],
) -> v2.Compose:
    # The augmentations run on PIL images, as in the reference: PIL's colour ops are faster than the tensor
    # kernels on 224-px crops (docs/benchmarks.md), and solarize at 128 on uint8 is exactly ImageOps.solarize's default.
    # size None: the photometric half alone (the crop and flip were made with the Gram teacher's, _same_box).
    steps: list[Any] = []
    if size is not None:
        steps += [
            v2.RandomResizedCrop(size, scale=scale, interpolation=interpolation, antialias=True),
            v2.RandomHorizontalFlip(p=flip_prob),
        ]
    steps += [
        v2.RandomApply([v2.ColorJitter(*color_jitter)], p=color_jitter_prob),
        v2.RandomGrayscale(p=grayscale_prob),
    ]
    if blur_prob > 0:
        steps.append(v2.RandomApply([GaussianBlur(blur_radius)], p=blur_prob))
    if solarize_prob > 0:
        steps.append(v2.RandomSolarize(threshold=solarize_threshold, p=solarize_prob))
    return v2.Compose(steps + shared_plain(mean, std))


def shared_plain(mean: Sequence[float], std: Sequence[float]) -> list[Any]:
    """To a float tensor, normalised: the end of every crop's pipeline, and all of the Gram teacher's."""
    return [
        v2.PILToTensor(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean=list(mean), std=list(std)),
    ]


class MultiCropTransform:
    """DINO multi-crop: ``[global_1, global_2, local_1, ..., local_N]`` normalised float tensors (3, H, W).

    Defaults are the reference's (``DataAugmentationDINO`` with ``main_dino.py``'s defaults): global crops of
    224 px at scale (0.4, 1), 8 local crops of 96 px at scale (0.05, 0.4), bicubic RandomResizedCrop, flip,
    colour jitter (0.4, 0.4, 0.2, 0.1) with p=0.8, grayscale p=0.2, blur with p = 1.0 / 0.1 / 0.5 on global 1 /
    global 2 / locals, solarize p=0.2 on global 2 only. The reference's XCiT runs (VISSL configs) used scales
    (0.3, 1) / (0.05, 0.3); every value here is a constructor argument.

    ``gram_crops_size`` (None: off; the datamodule sets it from the model) adds the Gram teacher's crops: the
    result is then ``{"crops": [...], "gram_crops": [gram_1, gram_2]}``, gram crop k of global crop k's box and
    flip at ``gram_crops_size``, with no photometric distortion (see the module docstring).
    """

    def __init__(
        self,
        global_crops_size: int = 224,
        global_crops_scale: tuple[float, float] = (0.4, 1.0),
        local_crops_number: int = 8,
        local_crops_size: int = 96,
        local_crops_scale: tuple[float, float] = (0.05, 0.4),
        global_blur_probs: tuple[float, float] = (1.0, 0.1),
        local_blur_prob: float = 0.5,
        global_solarize_probs: tuple[float, float] = (0.0, 0.2),
        local_solarize_prob: float = 0.0,
        blur_radius: tuple[float, float] = (0.1, 2.0),
        flip_prob: float = 0.5,
        color_jitter: tuple[float, float, float, float] = (0.4, 0.4, 0.2, 0.1),
        color_jitter_prob: float = 0.8,
        grayscale_prob: float = 0.2,
        solarize_threshold: int = 128,
        interpolation: str = "bicubic",
        mean: tuple[float, float, float] = IMAGENET_MEAN,
        std: tuple[float, float, float] = IMAGENET_STD,
        gram_crops_size: int | None = None,
    ) -> None:
        if local_crops_number < 0 or int(local_crops_number) != local_crops_number:
            raise UserError(f"local_crops_number must be an integer >= 0, got {local_crops_number!r}")
        if len(global_blur_probs) != 2 or len(global_solarize_probs) != 2:
            raise UserError(
                "global_blur_probs and global_solarize_probs need one probability per global crop (2 values), "
                f"got {tuple(global_blur_probs)!r} and {tuple(global_solarize_probs)!r}"
            )
        if len(color_jitter) != 4:
            raise UserError(
                f"color_jitter is (brightness, contrast, saturation, hue), got {tuple(color_jitter)!r}"
            )
        if not 0 <= solarize_threshold <= 255:
            raise UserError(f"solarize_threshold is on the uint8 scale 0..255, got {solarize_threshold!r}")
        self.config: dict[str, Any] = {
            "global_crops_size": _check_size("global_crops_size", global_crops_size),
            "global_crops_scale": _check_scale("global_crops_scale", global_crops_scale),
            "local_crops_number": int(local_crops_number),
            "local_crops_size": _check_size("local_crops_size", local_crops_size),
            "local_crops_scale": _check_scale("local_crops_scale", local_crops_scale),
            "global_blur_probs": tuple(_check_probability("global_blur_probs", p) for p in global_blur_probs),
            "local_blur_prob": _check_probability("local_blur_prob", local_blur_prob),
            "global_solarize_probs": tuple(
                _check_probability("global_solarize_probs", p) for p in global_solarize_probs
            ),
            "local_solarize_prob": _check_probability("local_solarize_prob", local_solarize_prob),
            "blur_radius": (float(blur_radius[0]), float(blur_radius[1])),
            "flip_prob": _check_probability("flip_prob", flip_prob),
            "color_jitter": tuple(float(v) for v in color_jitter),
            "color_jitter_prob": _check_probability("color_jitter_prob", color_jitter_prob),
            "grayscale_prob": _check_probability("grayscale_prob", grayscale_prob),
            "solarize_threshold": int(solarize_threshold),
            "interpolation": _interpolation(interpolation).value,
            "mean": tuple(float(v) for v in mean),
            "std": tuple(float(v) for v in std),
        }
        c = self.config
        shared = dict(
            flip_prob=c["flip_prob"],
            color_jitter=c["color_jitter"],
            color_jitter_prob=c["color_jitter_prob"],
            grayscale_prob=c["grayscale_prob"],
            blur_radius=c["blur_radius"],
            solarize_threshold=c["solarize_threshold"],
            interpolation=_interpolation(interpolation),
            mean=c["mean"],
            std=c["std"],
        )
        gsize, gscale = c["global_crops_size"], c["global_crops_scale"]
        self.global_transforms = [
            _crop_pipeline(gsize, gscale, c["global_blur_probs"][k], c["global_solarize_probs"][k], **shared)
            for k in range(2)
        ]
        # With Gram crops: the box and flip are drawn here (_same_box), the rest is each global crop's pipeline.
        self.global_photometric = [
            _crop_pipeline(None, gscale, c["global_blur_probs"][k], c["global_solarize_probs"][k], **shared)
            for k in range(2)
        ]
        self.plain = v2.Compose(shared_plain(c["mean"], c["std"]))
        self.gram_crops_size = (
            None if gram_crops_size is None else _check_size("gram_crops_size", gram_crops_size)
        )
        self.local_transform = _crop_pipeline(
            c["local_crops_size"],
            c["local_crops_scale"],
            c["local_blur_prob"],
            c["local_solarize_prob"],
            **shared,
        )

    @property
    def num_crops(self) -> int:
        return 2 + self.config["local_crops_number"]

    def __call__(self, image: Image.Image | torch.Tensor) -> list[torch.Tensor]:
        if isinstance(image, torch.Tensor) and image.is_floating_point():
            # Solarize's threshold and the colour ops are defined on the uint8 scale.
            image = F.to_dtype(image, torch.uint8, scale=True)
        if self.gram_crops_size is None:
            crops = [t(image) for t in self.global_transforms]
        else:
            crops, gram = [], []
            for photometric in self.global_photometric:  # box, flip, then photometric draws: as without
                global_crop, gram_crop = self._same_box(image)
                crops.append(photometric(global_crop))
                gram.append(self.plain(gram_crop))
        crops += [self.local_transform(image) for _ in range(self.config["local_crops_number"])]
        return crops if self.gram_crops_size is None else {"crops": crops, "gram_crops": gram}

    def _same_box(self, image: Image.Image | torch.Tensor) -> tuple[Any, Any]:
        """(global crop, Gram teacher's crop) of one box and flip, drawn as ``RandomResizedCrop`` then
        ``RandomHorizontalFlip`` draw them (the same torch draws as the pipeline without Gram crops)."""
        c = self.config
        height, width = F.get_size(image)
        shape_only = torch.empty(1).expand(1, height, width)  # get_params reads the shape only
        top, left, h, w = _V1RandomResizedCrop.get_params(
            shape_only, list(c["global_crops_scale"]), [3 / 4, 4 / 3]
        )
        flip = bool(torch.rand(1) < c["flip_prob"])
        mode = _interpolation(c["interpolation"])
        out = []
        for size in (c["global_crops_size"], self.gram_crops_size):
            crop = F.resized_crop(image, top, left, h, w, [size, size], interpolation=mode, antialias=True)
            out.append(F.horizontal_flip(crop) if flip else crop)
        return out[0], out[1]

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        gram = "" if self.gram_crops_size is None else f", gram_crops_size={self.gram_crops_size}"
        return f"{type(self).__name__}({args}{gram})"


def eval_transform(
    resize_size: int = 256,
    crop_size: int = 224,
    interpolation: str = "bicubic",
    mean: tuple[float, float, float] = IMAGENET_MEAN,
    std: tuple[float, float, float] = IMAGENET_STD,
    *,
    resize: int | None = None,
    crop: int | None = None,
) -> v2.Compose:
    """DINO's evaluation transform: resize the short side, center crop, normalise (k-NN, linear probe).

    ``resize`` / ``crop`` are accepted as aliases of ``resize_size`` / ``crop_size``.
    """
    resize_size = _check_size("resize_size", resize if resize is not None else resize_size)
    crop_size = _check_size("crop_size", crop if crop is not None else crop_size)
    if crop_size > resize_size:
        raise UserError(f"crop_size {crop_size} is larger than resize_size {resize_size}: the crop would pad")
    return v2.Compose(
        [
            v2.Resize(resize_size, interpolation=_interpolation(interpolation), antialias=True),
            v2.CenterCrop(crop_size),
            v2.PILToTensor(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=list(mean), std=list(std)),
        ]
    )


def describe_transform(transform: Any) -> str:
    """A stable one-line text description of a transform, for cache metadata (no memory addresses)."""
    if transform is None:
        return "None"
    text = repr(transform)
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", text)
    return re.sub(r"\s+", " ", text).strip()
