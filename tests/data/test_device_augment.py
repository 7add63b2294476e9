"""The device path's photometric augmentation against torchvision's definitions and against the CPU path.

Kernels: each per-sample op equals torchvision's functional op with that sample's factor. Distributions: the
same crops go through the CPU path (``MultiCropTransform``, PIL) and the device path (``MultiCropGeometry`` +
``PhotometricAugment``); what each op did is read back from the outputs on constructed images, and firing rates
must lie in a binomial confidence interval of the configured probability on both paths.
"""

from __future__ import annotations

import colorsys
import math

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from ssl_xcit.data.crops import MultiCropGeometry
from ssl_xcit.data.device_augment import (
    PhotometricAugment,
    adjust_brightness,
    adjust_contrast,
    adjust_hue,
    adjust_saturation,
    gaussian_blur,
)
from ssl_xcit.data.transforms import MultiCropTransform

N = 400  # samples per distribution test
SIZE = 16
# Everything off; each test switches on what it measures. Identity normalisation: outputs are x / 255.
OFF = dict(
    color_jitter=(0.0, 0.0, 0.0, 0.0),
    color_jitter_prob=0.0,
    grayscale_prob=0.0,
    global_blur_probs=(0.0, 0.0),
    local_blur_prob=0.0,
    global_solarize_probs=(0.0, 0.0),
    local_solarize_prob=0.0,
    mean=(0.0, 0.0, 0.0),
    std=(1.0, 1.0, 1.0),
)


def both_paths(image: np.ndarray, n: int = N, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """(CPU path, device path) outputs, each (n, 2, 3, S, S) in [0, 1]: the two global crops of ``n`` draws on
    ``image`` (uint8 HxWx3). Crops cover the whole image (scale 1, output = input size): the geometry is the
    identity, so outputs differ from the input by the photometric ops only."""
    opts = {**OFF, **options}
    pil = Image.fromarray(image)
    size = image.shape[0]
    torch.manual_seed(0)
    cpu = MultiCropTransform(
        global_crops_size=size, global_crops_scale=(1.0, 1.0), local_crops_number=0, flip_prob=0.0, **opts
    )
    cpu_out = torch.stack([torch.stack(cpu(pil)) for _ in range(n)])
    geometry = MultiCropGeometry(
        global_crops_size=size, global_crops_scale=(1.0, 1.0), local_crops_number=0, flip_prob=0.0
    )
    crops = [geometry(pil) for _ in range(n)]
    assert all(torch.equal(c, torch.from_numpy(image).permute(2, 0, 1)) for pair in crops for c in pair)
    batch = [torch.stack([pair[k] for pair in crops]) for k in range(2)]
    device_out = torch.stack(PhotometricAugment(**opts)(batch, np.random.default_rng(1)), dim=1)
    return cpu_out, device_out


def binomial_interval(n: int, p: float, confidence: float = 0.999) -> tuple[int, int]:
    """The central ``confidence`` interval of Binomial(n, p), from the exact pmf (no scipy in the deps)."""
    log_pmf = [
        math.lgamma(n + 1)
        - math.lgamma(k + 1)
        - math.lgamma(n - k + 1)
        + k * math.log(p)
        + (n - k) * math.log1p(-p)
        for k in range(n + 1)
    ]
    cdf = np.cumsum(np.exp(log_pmf))
    tail = (1 - confidence) / 2
    return int(np.searchsorted(cdf, tail)), int(np.searchsorted(cdf, 1 - tail))


def ks_same_distribution(a: np.ndarray, b: np.ndarray, alpha: float = 1e-3) -> bool:
    """Two-sample Kolmogorov-Smirnov test at level ``alpha`` (asymptotic critical value)."""
    grid = np.sort(np.concatenate([a, b]))
    fa = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    fb = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    critical = math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((len(a) + len(b)) / (len(a) * len(b)))
    return float(np.abs(fa - fb).max()) <= critical


def assert_rate(fired: torch.Tensor, p: float, label: str) -> None:
    """The firing rate lies in the 99.9 % Clopper-Pearson interval of ``p``'s binomial (or is exact at 0/1)."""
    k, n = int(fired.sum()), fired.numel()
    if p in (0.0, 1.0):
        assert k == round(p * n), f"{label}: fired {k}/{n}, expected always/never"
        return
    low, high = binomial_interval(n, p)
    assert low <= k <= high, f"{label}: fired {k}/{n}, outside [{low}, {high}] for p={p}"


def constant(rgb: tuple[int, int, int], size: int = SIZE) -> np.ndarray:
    return np.broadcast_to(np.array(rgb, dtype=np.uint8), (size, size, 3)).copy()


# ------------------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize(
    "ours,theirs,values",
    [
        (adjust_brightness, F.adjust_brightness, [0.6, 1.0, 1.4]),
        (adjust_contrast, F.adjust_contrast, [0.6, 1.0, 1.4]),
        (adjust_saturation, F.adjust_saturation, [0.0, 0.8, 1.2]),
        (adjust_hue, F.adjust_hue, [-0.5, -0.1, 0.0, 0.07, 0.5]),
    ],
)
def test_per_sample_ops_equal_torchvision_per_image(ours, theirs, values):
    torch.manual_seed(0)
    x = torch.rand(len(values), 3, 12, 10)
    x[0, :, :2] = 0.5  # grey pixels (zero chroma) take the hue's special case
    got = ours(x.clone(), torch.tensor(values))
    for i, value in enumerate(values):
        # 1e-4 (0.03 grey level): our luma is PIL's 0.299 (the CPU path's), torchvision's tensor one 0.2989.
        torch.testing.assert_close(got[i], theirs(x[i], value), atol=1e-4, rtol=0)


def test_per_sample_blur_equals_torchvision_blur_with_the_cpu_paths_kernel():
    torch.manual_seed(0)
    x = torch.rand(4, 3, 20, 24)
    sigmas = torch.tensor([0.1, 0.7, 1.3, 2.0])
    got = gaussian_blur(x, sigmas)
    for i, s in enumerate(sigmas.tolist()):
        half = math.ceil(3 * s)
        want = F.gaussian_blur(x[i], kernel_size=[2 * half + 1] * 2, sigma=[s, s])
        torch.testing.assert_close(got[i], want, atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------ firing rates
def test_firing_rates_of_every_op_on_both_paths():
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    # Grayscale fires <=> the output's channels are equal (a colourful image never has them equal otherwise).
    for out, path in zip(both_paths(noise, grayscale_prob=0.2), ("cpu", "device"), strict=True):
        for crop in range(2):
            gray = (out[:, crop, 0] == out[:, crop, 1]).all(-1).all(-1)
            assert_rate(gray, 0.2, f"{path} grayscale crop {crop}")
    # Colour jitter (brightness only) on mid grey: it fires <=> the pixel changed (a factor within 1/400 of 1
    # leaves grey 200 unchanged on the CPU path: a 0.6 % chance, small against the interval).
    grey = constant((200, 200, 200))
    for out, path in zip(
        both_paths(grey, color_jitter=(0.4, 0, 0, 0), color_jitter_prob=0.8), ("cpu", "device"), strict=True
    ):
        changed = (out[:, 0, 0, 0, 0] - 200 / 255).abs() > 0.5 / 255
        assert_rate(changed, 0.8, f"{path} colour jitter")
    # Blur (sigma >= 1 so every draw visibly blurs a checkerboard): DINO's 1.0 / 0.1 per global crop.
    board = np.kron((np.indices((SIZE, SIZE)).sum(0) % 2) * 255, np.ones((1, 1))).astype(np.uint8)
    board = np.repeat(board[..., None], 3, axis=2)
    for out, path in zip(
        both_paths(board, global_blur_probs=(1.0, 0.1), blur_radius=(1.0, 2.0)),
        ("cpu", "device"),
        strict=True,
    ):
        for crop, p in enumerate((1.0, 0.1)):
            blurred = (out[:, crop] - torch.from_numpy(board).permute(2, 0, 1) / 255).abs().amax(
                (1, 2, 3)
            ) > 0.1
            assert_rate(blurred, p, f"{path} blur crop {crop}")
    # Solarise on a bright image: 0 on the first global crop, 0.2 on the second.
    for out, path in zip(both_paths(grey, global_solarize_probs=(0.0, 0.2)), ("cpu", "device"), strict=True):
        for crop, p in enumerate((0.0, 0.2)):
            assert_rate(out[:, crop, 0, 0, 0] < 0.5, p, f"{path} solarise crop {crop}")


def test_device_draws_dinos_per_crop_probabilities_for_local_crops():
    augment = PhotometricAugment()
    params = augment.draw(np.full(4000, 0.5), np.zeros(4000), np.random.default_rng(0))
    assert_rate(torch.from_numpy(params.blur), 0.5, "local blur")
    assert not params.solarize.any()
    assert_rate(torch.from_numpy(params.jitter), 0.8, "jitter")
    assert_rate(torch.from_numpy(params.grayscale), 0.2, "grayscale")
    # Every one of the 24 orders of the four jitter ops occurs, at about 1/24 each.
    orders = np.unique(params.order, axis=0, return_counts=True)[1]
    assert len(orders) == 24
    expected = 4000 / 24
    chi2 = float(((orders - expected) ** 2 / expected).sum())
    assert chi2 < 49.73, chi2  # the 0.999 quantile of chi-square with 23 degrees of freedom


# ------------------------------------------------------------------------------------------ ranges
def _factor_samples(out: torch.Tensor, fired: torch.Tensor) -> np.ndarray:
    return out[fired].numpy()


def _check_uniform(name: str, cpu: np.ndarray, device: np.ndarray, low: float, high: float, tol: float):
    span = high - low
    for values, path in ((cpu, "cpu"), (device, "device")):
        assert values.min() >= low - tol and values.max() <= high + tol, (
            name,
            path,
            values.min(),
            values.max(),
        )
        # Both ends are reached (n draws miss the outer 5 % with probability 0.95^n).
        assert values.min() < low + 0.05 * span and values.max() > high - 0.05 * span, (name, path)
    # The same distribution on both paths.
    assert ks_same_distribution(cpu, device), name


def test_brightness_contrast_saturation_factor_ranges_match():
    opts = dict(color_jitter_prob=1.0)
    # Brightness: output / input on a constant grey below the clamp (100 * 1.4 < 255).
    cpu, dev = both_paths(constant((100, 100, 100)), color_jitter=(0.4, 0, 0, 0), **opts)
    _check_uniform(
        "brightness",
        cpu[:, 0, 0, 0, 0].numpy() / (100 / 255),
        dev[:, 0, 0, 0, 0].numpy() / (100 / 255),
        0.6,
        1.4,
        0.01,
    )
    # Contrast: the spread of a two-level image, relative to the input's.
    image = constant((80, 80, 80))
    image[:, SIZE // 2 :] = 160
    cpu, dev = both_paths(image, color_jitter=(0, 0.4, 0, 0), **opts)
    spread = lambda o: ((o[:, 0, 0, 0, -1] - o[:, 0, 0, 0, 0]) / (80 / 255)).numpy()  # noqa: E731
    _check_uniform("contrast", spread(cpu), spread(dev), 0.6, 1.4, 0.03)
    # Saturation: the red-green difference of a colour, relative to the input's.
    cpu, dev = both_paths(constant((180, 100, 60)), color_jitter=(0, 0, 0.2, 0), **opts)
    sat = lambda o: ((o[:, 0, 0, 0, 0] - o[:, 0, 1, 0, 0]) / (80 / 255)).numpy()  # noqa: E731
    _check_uniform("saturation", sat(cpu), sat(dev), 0.8, 1.2, 0.03)


def test_hue_shift_range_matches():
    cpu, dev = both_paths(constant((200, 60, 60)), color_jitter=(0, 0, 0, 0.1), color_jitter_prob=1.0)

    def shifts(out: torch.Tensor) -> np.ndarray:
        h = [colorsys.rgb_to_hsv(*out[i, 0, :, 0, 0].tolist())[0] for i in range(len(out))]
        return (np.array(h) + 0.5) % 1.0 - 0.5  # the input's hue is 0

    # PIL works on a uint8 hue (1/256 turn): tolerance 1/100 turn.
    _check_uniform("hue", shifts(cpu), shifts(dev), -0.1, 0.1, 0.01)


def test_blur_sigma_range_matches():
    # A bright vertical line: the blurred profile's variance along x is sigma^2.
    image = constant((0, 0, 0), size=33)
    image[:, 16] = 255
    cpu, dev = both_paths(image, n=200, global_blur_probs=(1.0, 1.0), blur_radius=(0.1, 2.0))

    def sigmas(out: torch.Tensor) -> np.ndarray:
        profile = out[:, 0, 0, 16].double()
        x = torch.arange(33, dtype=torch.float64) - 16
        return ((profile * x**2).sum(1) / profile.sum(1)).sqrt().numpy()

    cpu_s, dev_s = sigmas(cpu), sigmas(dev)
    for values, path in ((cpu_s, "cpu"), (dev_s, "device")):
        # PIL's box approximation and its uint8 tails blur the estimate of small sigmas: 0.15 px tolerance.
        assert values.min() >= 0.0 and values.max() <= 2.15, (path, values.min(), values.max())
        assert values.max() > 1.85 and values.min() < 0.3, (path, values.min(), values.max())
    assert np.median(np.abs(np.sort(cpu_s) - np.sort(dev_s))) < 0.1


def test_solarise_threshold_is_128_on_both_paths():
    ramp = np.repeat(np.arange(256, dtype=np.uint8)[None, :, None], 3, axis=2).repeat(4, axis=0)
    ramp = np.ascontiguousarray(np.pad(ramp, ((0, 252), (0, 0), (0, 0))))  # square 256 x 256
    cpu, dev = both_paths(ramp, n=2, global_solarize_probs=(1.0, 1.0))
    levels = torch.arange(256, dtype=torch.float32) / 255
    want = torch.where(levels >= 128 / 255, 1 - levels, levels)
    for out in (cpu, dev):
        torch.testing.assert_close(out[0, 0, 0, 0], want, atol=1e-6, rtol=0)


def test_grayscale_gives_equal_channels_with_pils_luma():
    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    cpu, dev = both_paths(image, n=4, grayscale_prob=1.0)
    luma = torch.from_numpy(np.array(Image.fromarray(image).convert("L"))).float() / 255
    for out in (cpu, dev):
        assert torch.equal(out[:, :, 0], out[:, :, 1]) and torch.equal(out[:, :, 1], out[:, :, 2])
        # PIL rounds to uint8; the device path keeps the float luma.
        assert (out[:, :, 0] - luma).abs().max() <= 0.5 / 255 + 1e-6


# ------------------------------------------------------------------------------------------ plumbing
def test_same_generator_seed_same_augmentation_and_groups_by_resolution():
    torch.manual_seed(0)
    crops = [torch.randint(0, 256, (3, 3, s, s), dtype=torch.uint8) for s in (16, 16, 8, 8, 8)]
    augment = PhotometricAugment()
    a = augment(crops, 5)
    b = augment(crops, np.random.default_rng(5))
    c = augment(crops, 6)
    assert [t.shape for t in a] == [t.shape for t in crops] and all(t.dtype == torch.float32 for t in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    # A torch generator (the benchmarks' random source) gives a seed: the same generator state, the same draws.
    d = augment(crops, torch.Generator().manual_seed(5))
    e = augment(crops, torch.Generator().manual_seed(5))
    assert all(torch.equal(x, y) for x, y in zip(d, e, strict=True))


def test_float_crops_are_refused_not_silently_augmented_differently():
    with pytest.raises(TypeError, match="uint8 crops.*augment_on=cpu"):
        PhotometricAugment()([torch.rand(2, 3, 8, 8)] * 2, 0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(color_jitter=(0.4, 0.4, 0.2, 0.6)), r"hue must be in \[0, 0.5\].*0.6"),
        (dict(color_jitter=(-0.1, 0.4, 0.2, 0.1)), "brightness must be >= 0"),
        (dict(blur_radius=(0.0, 2.0)), "blur radius"),
        (dict(local_blur_prob=1.5), r"probabilities must lie in \[0, 1\]"),
        (dict(solarize_threshold=300), "0..255"),
    ],
)
def test_bad_options_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PhotometricAugment(**kwargs)
