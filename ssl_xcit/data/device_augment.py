"""DINO's photometric augmentation, batched on the training device with per-sample random parameters.

With ``augment_on="device"`` the DataLoader workers only decode, crop, resize and flip (``ssl_xcit.data.crops``)
and deliver uint8 crops; :class:`PhotometricAugment` then runs, after the batch reached the device, the rest of
``MultiCropTransform``: colour jitter (brightness, contrast, saturation, hue in a random order per sample, with
probability ``color_jitter_prob``), random grayscale, Gaussian blur with a random sigma, solarisation and
normalisation, with DINO's per-crop probabilities.

The distributions are the CPU path's (torchvision ``ColorJitter`` / ``RandomGrayscale`` / ``RandomSolarize`` and
our ``GaussianBlur``): factors uniform in ``[max(0, 1 - x), 1 + x]``, hue shift uniform in ``[-h, h]``, one of
the 24 orders uniformly, sigma uniform in ``blur_radius``, solarise inverting values ``>= threshold``, grayscale
with ITU-R 601-2 luma (PIL's ``convert("L")`` weights). The arithmetic is float from the uint8 input to the
normalised output, so it skips the CPU path's rounding to uint8 after each operation (a difference of at most
half a grey level per operation).

Why our own kernels instead of kornia or torchvision: torchvision's v2 functional colour ops take one factor per
call, so per-sample factors need a Python loop over samples; kornia's ``ColorJitter`` draws one order of the
four operations per batch, where the CPU path draws one per image, and kornia's brightness/contrast functions
differ from torchvision's definitions. The few lines below implement the torchvision definitions with a factor
per sample; ``benchmarks/bench_dataloading.py --compare-augment`` times them against both libraries.

Random parameters are drawn on the CPU from a ``torch.Generator`` the caller owns (the datamodule seeds it from
the run's seed and the rank, and checkpoints its state), so a seeded run draws the same augmentations on any
device, and every subset index is known without a device-to-host synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as nnf

from ssl_xcit.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from ssl_xcit.errors import UserError

# ITU-R 601-2 luma, as PIL's convert("L") and torchvision's rgb_to_grayscale.
_LUMA = (0.299, 0.587, 0.114)
BRIGHTNESS, CONTRAST, SATURATION, HUE = range(4)


@dataclass
class CropParams:
    """Random parameters of ``n`` crops (CPU tensors). ``order[i]`` is the jitter order of crop i."""

    jitter: torch.Tensor  # bool (n,)
    order: torch.Tensor  # int64 (n, 4), a permutation of 0..3 per row
    factors: torch.Tensor  # float (n, 4): brightness, contrast, saturation factors and hue shift
    grayscale: torch.Tensor  # bool (n,)
    blur: torch.Tensor  # bool (n,)
    sigma: torch.Tensor  # float (n,)
    solarize: torch.Tensor  # bool (n,)


def _grayscale(x: torch.Tensor) -> torch.Tensor:
    r, g, b = x.unbind(1)
    return (_LUMA[0] * r + _LUMA[1] * g + _LUMA[2] * b).unsqueeze(1)


def _per_row(f: torch.Tensor) -> torch.Tensor:
    return f.view(-1, 1, 1, 1)


def adjust_brightness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """torchvision's brightness on floats in [0, 1]: ``x * f`` clamped, one factor per sample."""
    return (x * _per_row(factor)).clamp_(0.0, 1.0)


def adjust_contrast(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """torchvision's contrast: blend with the image's mean grey level, one factor per sample."""
    mean = _grayscale(x).mean(dim=(1, 2, 3), keepdim=True)
    f = _per_row(factor)
    return (x * f + mean * (1.0 - f)).clamp_(0.0, 1.0)


def adjust_saturation(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """torchvision's saturation: blend with the image's grayscale version, one factor per sample."""
    f = _per_row(factor)
    return (x * f + _grayscale(x) * (1.0 - f)).clamp_(0.0, 1.0)


def adjust_hue(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Rotate the hue by ``shift`` turns (in [-0.5, 0.5]) per sample, in HSV as torchvision does."""
    maxc, _ = x.max(dim=1, keepdim=True)
    minc, _ = x.min(dim=1, keepdim=True)
    chroma = maxc - minc
    safe = torch.where(chroma > 0, chroma, torch.ones_like(chroma))
    r, g, b = x.split(1, dim=1)
    # Hue in sixths of a turn (colorsys' formula), then shifted and wrapped to [0, 6).
    h = torch.where(
        maxc == r, (g - b) / safe, torch.where(maxc == g, 2.0 + (b - r) / safe, 4.0 + (r - g) / safe)
    )
    h = torch.where(chroma > 0, h, torch.zeros_like(h))
    h = torch.remainder(h + 6.0 * _per_row(shift), 6.0)
    # HSV -> RGB without branches: channel n is v - c * clamp(min(k, 4 - k), 0, 1), k = (n + h) mod 6.
    n = torch.tensor([5.0, 3.0, 1.0], device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    k = torch.remainder(n + h, 6.0)
    return maxc - chroma * torch.minimum(k, 4.0 - k).clamp_(0.0, 1.0)


def gaussian_blur(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Separable Gaussian blur with one sigma per sample, the CPU tensor path's kernel: ``2 ceil(3 sigma) + 1``
    taps (half-width capped at the image side - 1), reflection padding. All samples share one convolution of the
    largest width; a sample's taps beyond its own half-width are zero."""
    n, c, h, w = x.shape
    halves = torch.clamp(torch.ceil(3.0 * sigma), max=min(h, w) - 1)
    width = int(halves.max().item())
    offsets = torch.arange(-width, width + 1, dtype=torch.float32)
    kernel = torch.exp(-0.5 * (offsets / sigma.view(-1, 1).float()) ** 2)
    kernel = kernel * (offsets.abs() <= halves.view(-1, 1))
    kernel = (kernel / kernel.sum(dim=1, keepdim=True)).to(device=x.device, dtype=x.dtype)
    weight = kernel.repeat_interleave(c, dim=0)  # (n * c, 2 * width + 1)
    out = nnf.pad(x.reshape(1, n * c, h, w), (width, width, width, width), mode="reflect")
    out = nnf.conv2d(out, weight.view(n * c, 1, 1, -1), groups=n * c)
    out = nnf.conv2d(out, weight.view(n * c, 1, -1, 1), groups=n * c)
    return out.view(n, c, h, w)


class PhotometricAugment:
    """The photometric half of DINO's multi-crop, on batches of uint8 crops, with per-sample parameters.

    Args mirror ``MultiCropTransform``'s: ``global_blur_probs`` / ``global_solarize_probs`` are per global crop
    (the first two crops), ``local_*`` apply to the others. Call it on the list of crops of a batch (uint8
    ``(B, 3, H, W)`` tensors, any device) with a CPU generator; it returns normalised float32 crops.
    """

    def __init__(
        self,
        color_jitter: Sequence[float] = (0.4, 0.4, 0.2, 0.1),
        color_jitter_prob: float = 0.8,
        grayscale_prob: float = 0.2,
        global_blur_probs: Sequence[float] = (1.0, 0.1),
        local_blur_prob: float = 0.5,
        global_solarize_probs: Sequence[float] = (0.0, 0.2),
        local_solarize_prob: float = 0.0,
        blur_radius: Sequence[float] = (0.1, 2.0),
        solarize_threshold: int = 128,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> None:
        if len(color_jitter) != 4:
            raise UserError(
                f"color_jitter is (brightness, contrast, saturation, hue), got {tuple(color_jitter)!r}"
            )
        brightness, contrast, saturation, hue = (float(v) for v in color_jitter)
        for name, value in (("brightness", brightness), ("contrast", contrast), ("saturation", saturation)):
            if value < 0:
                raise UserError(f"color_jitter {name} must be >= 0, got {value!r}")
        if not 0.0 <= hue <= 0.5:
            raise UserError(f"color_jitter hue must be in [0, 0.5] (a fraction of a turn), got {hue!r}")
        if len(blur_radius) != 2 or not 0.0 < blur_radius[0] <= blur_radius[1]:
            raise UserError(f"blur radius must be (min, max) with 0 < min <= max, got {tuple(blur_radius)!r}")
        if not 0 <= solarize_threshold <= 255:
            raise UserError(f"solarize_threshold is on the uint8 scale 0..255, got {solarize_threshold!r}")
        probs = [color_jitter_prob, grayscale_prob, local_blur_prob, local_solarize_prob]
        probs += [*global_blur_probs, *global_solarize_probs]
        if (
            len(global_blur_probs) != 2
            or len(global_solarize_probs) != 2
            or not all(0 <= p <= 1 for p in probs)
        ):
            raise UserError(
                "probabilities must lie in [0, 1], with 2 values for global_blur_probs and global_solarize_probs, "
                f"got {probs!r}"
            )
        self.ranges = torch.tensor(
            [
                [max(0.0, 1.0 - brightness), 1.0 + brightness],
                [max(0.0, 1.0 - contrast), 1.0 + contrast],
                [max(0.0, 1.0 - saturation), 1.0 + saturation],
                [-hue, hue],
            ]
        )
        self.color_jitter_prob = float(color_jitter_prob)
        self.grayscale_prob = float(grayscale_prob)
        self.global_blur_probs = tuple(float(p) for p in global_blur_probs)
        self.local_blur_prob = float(local_blur_prob)
        self.global_solarize_probs = tuple(float(p) for p in global_solarize_probs)
        self.local_solarize_prob = float(local_solarize_prob)
        self.blur_radius = (float(blur_radius[0]), float(blur_radius[1]))
        self.solarize_threshold = int(solarize_threshold)
        self.mean = tuple(float(v) for v in mean)
        self.std = tuple(float(v) for v in std)

    def crop_probs(self, crop: int) -> tuple[float, float]:
        """(blur, solarize) probability of crop number ``crop`` (0 and 1 are the global crops)."""
        if crop < 2:
            return self.global_blur_probs[crop], self.global_solarize_probs[crop]
        return self.local_blur_prob, self.local_solarize_prob

    def draw(self, blur_p: torch.Tensor, solarize_p: torch.Tensor, generator: torch.Generator) -> CropParams:
        """Parameters for ``len(blur_p)`` crops with the given per-crop blur and solarise probabilities."""
        n = blur_p.numel()

        def rand(*shape: int) -> torch.Tensor:
            return torch.rand(*shape, generator=generator)

        jitter = rand(n) < self.color_jitter_prob
        order = rand(n, 4).argsort(dim=1)  # a uniformly random permutation per row
        low, high = self.ranges[:, 0], self.ranges[:, 1]
        factors = low + (high - low) * rand(n, 4)
        grayscale = rand(n) < self.grayscale_prob
        blur = rand(n) < blur_p
        sigma = self.blur_radius[0] + (self.blur_radius[1] - self.blur_radius[0]) * rand(n)
        solarize = rand(n) < solarize_p
        return CropParams(jitter, order, factors, grayscale, blur, sigma, solarize)

    def apply(self, x: torch.Tensor, params: CropParams) -> torch.Tensor:
        """Augment uint8 crops ``x`` (n, 3, H, W) with ``params``; normalised float32 out."""
        if x.dtype != torch.uint8:
            raise TypeError(
                f"the device augmentation expects uint8 crops from the loader (data.augment_on=device), got "
                f"{x.dtype}; with float crops use data.augment_on=cpu"
            )
        device = x.device
        x = x.float().div_(255.0)

        def subset(mask: torch.Tensor) -> torch.Tensor | None:
            idx = mask.nonzero().flatten()  # a CPU tensor: no device synchronisation
            return idx.to(device, non_blocking=True) if idx.numel() else None

        ops = (adjust_brightness, adjust_contrast, adjust_saturation, adjust_hue)
        factors = params.factors.to(device, non_blocking=True)
        for position in range(4):
            for op in range(4):
                if op != HUE and self.ranges[op].tolist() == [1.0, 1.0]:
                    continue  # strength 0: the identity, as torchvision skips it
                if op == HUE and self.ranges[HUE, 1] == 0:
                    continue
                idx = subset(params.jitter & (params.order[:, position] == op))
                if idx is not None:
                    x.index_copy_(
                        0, idx, ops[op](x.index_select(0, idx), factors.index_select(0, idx)[:, op])
                    )
        idx = subset(params.grayscale)
        if idx is not None:
            x.index_copy_(0, idx, _grayscale(x.index_select(0, idx)).expand(-1, 3, -1, -1))
        if params.blur.any():
            rows = params.blur.nonzero().flatten()
            idx = rows.to(device, non_blocking=True)
            x.index_copy_(0, idx, gaussian_blur(x.index_select(0, idx), params.sigma[rows]))
        idx = subset(params.solarize)
        if idx is not None:
            part = x.index_select(0, idx)
            # RandomSolarize on uint8 inverts values >= threshold (PIL's ImageOps.solarize too).
            part = torch.where(part >= self.solarize_threshold / 255.0, 1.0 - part, part)
            x.index_copy_(0, idx, part)
        mean = torch.tensor(self.mean, device=device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=device).view(1, 3, 1, 1)
        return x.sub_(mean).div_(std)

    def __call__(self, crops: Sequence[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
        """Augment a batch's crops (crop k is a (B, 3, H, W) uint8 tensor); same-size crops run as one batch."""
        out: list[torch.Tensor] = []
        start = 0
        while start < len(crops):
            end = start + 1
            while end < len(crops) and crops[end].shape[-2:] == crops[start].shape[-2:]:
                end += 1
            group = crops[start:end]
            sizes = [c.shape[0] for c in group]
            probs = [self.crop_probs(k) for k in range(start, end)]
            blur_p = torch.cat([torch.full((b,), p[0]) for b, p in zip(sizes, probs, strict=True)])
            solarize_p = torch.cat([torch.full((b,), p[1]) for b, p in zip(sizes, probs, strict=True)])
            params = self.draw(blur_p, solarize_p, generator)
            out += list(self.apply(torch.cat(list(group)), params).split(sizes))
            start = end
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(ranges={self.ranges.tolist()}, color_jitter_prob={self.color_jitter_prob}, "
            f"grayscale_prob={self.grayscale_prob}, global_blur_probs={self.global_blur_probs}, "
            f"local_blur_prob={self.local_blur_prob}, global_solarize_probs={self.global_solarize_probs}, "
            f"local_solarize_prob={self.local_solarize_prob}, blur_radius={self.blur_radius}, "
            f"solarize_threshold={self.solarize_threshold}, mean={self.mean}, std={self.std})"
        )


def seed_for_rank(seed: int, rank: int) -> int:
    """A generator seed per rank (ranks must not draw the same augmentations for different images)."""
    return (int(seed) * 1_000_003 + int(rank)) % (2**63 - 1)
