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

The work splits in two halves so that the device never waits on the host:

- :meth:`PhotometricAugment.plan` runs on the host, in numpy only: it draws every random parameter from a
  ``numpy.random.Generator`` the caller derives per batch (the datamodule seeds it from the run's seed, the rank
  and the batch's position in the loop, as the iBOT masks are), finds which crops each operation applies to,
  builds the blur kernels, and packs all of it, with the normalisation constants, into one byte buffer;
- :meth:`PhotometricAugment.run` copies that buffer to the crops' device in one transfer (pinned and
  ``non_blocking`` on CUDA) and runs the kernels on views of it. Every index is known on the host, so no
  device value is ever read back (no ``.item()``, ``nonzero`` or boolean-mask indexing on the device), and no
  tensor is built from Python values on the device (each such build is a blocking copy from pageable memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as nnf

from ssl_xcit.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from ssl_xcit.errors import UserError

# ITU-R 601-2 luma, as PIL's convert("L") and torchvision's rgb_to_grayscale.
_LUMA = (0.299, 0.587, 0.114)
BRIGHTNESS, CONTRAST, SATURATION, HUE = range(4)
RandomSource = np.random.Generator | int | Sequence[int] | torch.Generator


@dataclass
class CropParams:
    """Random parameters of ``n`` crops (numpy arrays). ``order[i]`` is the jitter order of crop i."""

    jitter: np.ndarray  # bool (n,)
    order: np.ndarray  # int64 (n, 4), a permutation of 0..3 per row
    factors: np.ndarray  # float (n, 4): brightness, contrast, saturation factors and hue shift
    grayscale: np.ndarray  # bool (n,)
    blur: np.ndarray  # bool (n,)
    sigma: np.ndarray  # float (n,)
    solarize: np.ndarray  # bool (n,)


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
    # HSV -> RGB without branches: channel n is v - c * clamp(min(k, 4 - k), 0, 1), k = (n + h) mod 6, with
    # n = 5, 3, 1 for R, G, B (Python scalars: a constant tensor would be a host-to-device copy per call).
    k = torch.remainder(torch.cat([h + 5.0, h + 3.0, h + 1.0], dim=1), 6.0)
    return maxc - chroma * torch.minimum(k, 4.0 - k).clamp_(0.0, 1.0)


def blur_kernels(sigma: np.ndarray, height: int, width: int) -> np.ndarray:
    """The CPU tensor path's 1-D Gaussian kernels, one row per sigma: ``2 ceil(3 sigma) + 1`` taps (half-width
    capped at the image side - 1), all padded with zeros to the widest one, each summing to 1."""
    sigma = np.asarray(sigma, dtype=np.float64).reshape(-1)
    halves = np.minimum(np.ceil(3.0 * sigma), min(height, width) - 1)
    reach = int(halves.max())
    offsets = np.arange(-reach, reach + 1, dtype=np.float64)
    kernel = np.exp(-0.5 * (offsets / sigma[:, None]) ** 2) * (np.abs(offsets) <= halves[:, None])
    return (kernel / kernel.sum(axis=1, keepdims=True)).astype(np.float32)


def _blur(x: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """Separable blur of ``x`` (n, c, h, w) with one 1-D kernel per sample (n, 2 r + 1), reflection padding.
    All samples share one grouped convolution of the widest kernel."""
    n, c, h, w = x.shape
    reach = (kernel.shape[1] - 1) // 2
    weight = kernel.to(x.dtype).repeat_interleave(c, dim=0)  # (n * c, 2 r + 1)
    out = nnf.pad(x.reshape(1, n * c, h, w), (reach, reach, reach, reach), mode="reflect")
    out = nnf.conv2d(out, weight.view(n * c, 1, 1, -1), groups=n * c)
    out = nnf.conv2d(out, weight.view(n * c, 1, -1, 1), groups=n * c)
    return out.view(n, c, h, w)


def gaussian_blur(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Separable Gaussian blur with one sigma per sample (a CPU tensor), the CPU tensor path's kernel (see
    :func:`blur_kernels`), reflection padding."""
    kernel = blur_kernels(sigma.detach().cpu().double().numpy(), *x.shape[-2:])
    return _blur(x, torch.from_numpy(kernel).to(x.device))


def as_rng(source: RandomSource) -> np.random.Generator:
    """A numpy generator from a generator, a seed or seed sequence, or a torch CPU generator (which gives a
    seed: drawn on the host, so not inside ``FakeTensorMode``)."""
    if isinstance(source, torch.Generator):
        return np.random.default_rng(int(torch.randint(0, 2**63 - 1, (1,), generator=source)))
    return np.random.default_rng(source)


def _check_uint8(crops: Sequence[torch.Tensor]) -> None:
    for crop in crops:
        if crop.dtype != torch.uint8:
            raise TypeError(
                f"the device augmentation expects uint8 crops from the loader (data.augment_on=device), got "
                f"{crop.dtype}; with float crops use data.augment_on=cpu"
            )


class _Packer:
    """Collects int64 and float32 arrays for one host-to-device copy; returns each one's (start, end) in
    its section."""

    def __init__(self) -> None:
        self.ints: list[np.ndarray] = []
        self.floats: list[np.ndarray] = []
        self.n_ints = self.n_floats = 0

    def int(self, values: np.ndarray) -> tuple[int, int]:
        self.ints.append(np.ascontiguousarray(values, dtype=np.int64).reshape(-1))
        self.n_ints += self.ints[-1].size
        return self.n_ints - self.ints[-1].size, self.n_ints

    def float(self, values: np.ndarray) -> tuple[int, int]:
        self.floats.append(np.ascontiguousarray(values, dtype=np.float32).reshape(-1))
        self.n_floats += self.floats[-1].size
        return self.n_floats - self.floats[-1].size, self.n_floats

    def buffer(self) -> np.ndarray:
        """The int64 section, then the float32 one, as bytes (the int64 section keeps the floats aligned)."""
        parts = [a.view(np.uint8) for a in (*self.ints, *self.floats)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)


Span = tuple[int, int]


@dataclass
class _GroupPlan:
    """What to do to one same-size group of crops: ``jitter`` steps ``(op, crop indices, factors)`` in
    order, then grayscale, blur ``(indices, kernels, kernel width)`` and solarise; spans index the buffer."""

    sizes: list[int]
    jitter: list[tuple[int, Span, Span]] = field(default_factory=list)
    grayscale: Span | None = None
    blur: tuple[Span, Span, int] | None = None
    solarize: Span | None = None


@dataclass
class AugmentPlan:
    """The host half's result for one batch: the packed buffer and what each group does with it."""

    buffer: np.ndarray  # uint8: int64 section (n_ints values), then float32 section
    n_ints: int
    groups: list[_GroupPlan]
    normalise: tuple[Span, Span]  # mean and std spans in the float section
    params: list[CropParams]  # per group that draws (not the plain ones), for inspection and tests


class PhotometricAugment:
    """The photometric half of DINO's multi-crop, on batches of uint8 crops, with per-sample parameters.

    Args mirror ``MultiCropTransform``'s: ``global_blur_probs`` / ``global_solarize_probs`` are per global crop
    (the first two crops), ``local_*`` apply to the others. Call it on the list of crops of a batch (uint8
    ``(B, 3, H, W)`` tensors, any device) with a random source (see :func:`as_rng`); it returns normalised
    float32 crops.
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
        self.ranges = np.array(
            [
                [max(0.0, 1.0 - brightness), 1.0 + brightness],
                [max(0.0, 1.0 - contrast), 1.0 + contrast],
                [max(0.0, 1.0 - saturation), 1.0 + saturation],
                [-hue, hue],
            ]
        )
        # Strength 0 is the identity, which torchvision skips: so do we.
        self.active_ops = [op for op in range(4) if (self.ranges[op] != (0.0 if op == HUE else 1.0)).any()]
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

    def draw(self, blur_p: np.ndarray, solarize_p: np.ndarray, rng: RandomSource) -> CropParams:
        """Parameters for ``len(blur_p)`` crops with the given per-crop blur and solarise probabilities."""
        rng = as_rng(rng)
        blur_p, solarize_p = np.asarray(blur_p, dtype=np.float64), np.asarray(solarize_p, dtype=np.float64)
        n = blur_p.size
        jitter = rng.random(n) < self.color_jitter_prob
        order = rng.random((n, 4)).argsort(axis=1)  # a uniformly random permutation per row
        low, high = self.ranges[:, 0], self.ranges[:, 1]
        factors = low + (high - low) * rng.random((n, 4))
        grayscale = rng.random(n) < self.grayscale_prob
        blur = rng.random(n) < blur_p
        sigma = self.blur_radius[0] + (self.blur_radius[1] - self.blur_radius[0]) * rng.random(n)
        solarize = rng.random(n) < solarize_p
        return CropParams(jitter, order, factors, grayscale, blur, sigma, solarize)

    # ------------------------------------------------------------------------------------------ host half
    def plan(self, shapes: Sequence[Sequence[int]], rng: RandomSource, plain: int = 0) -> AugmentPlan:
        """Draw the parameters of a batch whose crop k has shape ``shapes[k]`` (B, 3, H, W) and pack
        everything the device half needs. Same-size crops form one group (one batched pass). The last
        ``plain`` crops (the Gram teacher's) are only normalised, and draw nothing."""
        rng = as_rng(rng)
        packer = _Packer()
        groups, drawn = [], []
        start = 0
        while start < len(shapes):
            end = start + 1
            while end < len(shapes) and tuple(shapes[end][-2:]) == tuple(shapes[start][-2:]):
                end += 1
            if start < len(shapes) - plain < end:  # a plain run starts inside: split the group there
                end = len(shapes) - plain
            sizes = [int(s[0]) for s in shapes[start:end]]
            if start >= len(shapes) - plain:
                groups.append(_GroupPlan(sizes))  # no operation: the float conversion and normalisation only
                start = end
                continue
            probs = [self.crop_probs(k) for k in range(start, end)]
            blur_p = np.concatenate([np.full(b, p[0]) for b, p in zip(sizes, probs, strict=True)])
            solarize_p = np.concatenate([np.full(b, p[1]) for b, p in zip(sizes, probs, strict=True)])
            params = self.draw(blur_p, solarize_p, rng)
            groups.append(self._plan_group(params, sizes, tuple(shapes[start][-2:]), packer))
            drawn.append(params)
            start = end
        normalise = (packer.float(np.array(self.mean)), packer.float(np.array(self.std)))
        return AugmentPlan(packer.buffer(), packer.n_ints, groups, normalise, drawn)

    def _plan_group(
        self, params: CropParams, sizes: list[int], size: tuple[int, int], packer: _Packer
    ) -> _GroupPlan:
        group = _GroupPlan(sizes)
        for position in range(4):
            for op in self.active_ops:
                rows = np.flatnonzero(params.jitter & (params.order[:, position] == op))
                if rows.size:
                    group.jitter.append((op, packer.int(rows), packer.float(params.factors[rows, op])))
        if params.grayscale.any():
            group.grayscale = packer.int(np.flatnonzero(params.grayscale))
        if params.blur.any():
            rows = np.flatnonzero(params.blur)
            kernel = blur_kernels(params.sigma[rows], *size)
            group.blur = (packer.int(rows), packer.float(kernel), kernel.shape[1])
        if params.solarize.any():
            group.solarize = packer.int(np.flatnonzero(params.solarize))
        return group

    # ---------------------------------------------------------------------------------------- device half
    def run(self, crops: Sequence[torch.Tensor], plan: AugmentPlan) -> list[torch.Tensor]:
        """Augment a batch's uint8 crops on their device with ``plan`` (from :meth:`plan` on their shapes)."""
        _check_uint8(crops)
        if not crops:
            return []
        device = crops[0].device
        host = torch.from_numpy(plan.buffer)
        if device.type == "cuda" and torch.cuda.is_available():
            host = host.pin_memory()  # a copy from pageable memory would wait for the device's queue
        packed = host.to(device, non_blocking=True)
        ints = packed[: 8 * plan.n_ints].view(torch.int64)
        floats = packed[8 * plan.n_ints :].view(torch.float32)

        def span(values: torch.Tensor, where: Span) -> torch.Tensor:
            return values[where[0] : where[1]]

        mean, std = (span(floats, s).view(1, 3, 1, 1) for s in plan.normalise)
        out: list[torch.Tensor] = []
        start = 0
        for group in plan.groups:
            end = start + len(group.sizes)
            x = self._apply(torch.cat(list(crops[start:end])), group, ints, floats, span)
            out += list(x.sub_(mean).div_(std).split(group.sizes))
            start = end
        if start != len(crops):
            raise ValueError(f"the plan covers {start} crops, the batch has {len(crops)}")
        return out

    def _apply(self, x: torch.Tensor, group: _GroupPlan, ints, floats, span) -> torch.Tensor:
        x = x.float().div_(255.0)
        ops = (adjust_brightness, adjust_contrast, adjust_saturation, adjust_hue)
        for op, rows, factors in group.jitter:
            idx = span(ints, rows)
            x.index_copy_(0, idx, ops[op](x.index_select(0, idx), span(floats, factors)))
        if group.grayscale is not None:
            idx = span(ints, group.grayscale)
            x.index_copy_(0, idx, _grayscale(x.index_select(0, idx)).expand(-1, 3, -1, -1))
        if group.blur is not None:
            rows, kernel, width = group.blur
            idx = span(ints, rows)
            x.index_copy_(0, idx, _blur(x.index_select(0, idx), span(floats, kernel).view(-1, width)))
        if group.solarize is not None:
            idx = span(ints, group.solarize)
            part = x.index_select(0, idx)
            # RandomSolarize on uint8 inverts values >= threshold (PIL's ImageOps.solarize too).
            part = torch.where(part >= self.solarize_threshold / 255.0, 1.0 - part, part)
            x.index_copy_(0, idx, part)
        return x

    def __call__(
        self, crops: Sequence[torch.Tensor], rng: RandomSource, plain: int = 0
    ) -> list[torch.Tensor]:
        """Augment a batch's crops (crop k is a (B, 3, H, W) uint8 tensor); same-size crops run as one batch.
        The last ``plain`` crops are only normalised (see :meth:`plan`)."""
        _check_uint8(crops)
        return self.run(crops, self.plan([tuple(c.shape) for c in crops], rng, plain))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(ranges={self.ranges.tolist()}, color_jitter_prob={self.color_jitter_prob}, "
            f"grayscale_prob={self.grayscale_prob}, global_blur_probs={self.global_blur_probs}, "
            f"local_blur_prob={self.local_blur_prob}, global_solarize_probs={self.global_solarize_probs}, "
            f"local_solarize_prob={self.local_solarize_prob}, blur_radius={self.blur_radius}, "
            f"solarize_threshold={self.solarize_threshold}, mean={self.mean}, std={self.std})"
        )
