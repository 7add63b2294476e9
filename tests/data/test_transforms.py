from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter
from torchvision.transforms.v2 import functional as F

from ssl_xcit.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    GaussianBlur,
    MultiCropTransform,
    describe_transform,
    eval_transform,
)

MEAN = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
STD = torch.tensor(IMAGENET_STD).view(3, 1, 1)


def uniform_image(value: int, size: int = 40) -> Image.Image:
    return Image.new("RGB", (size, size), (value, value, value))


def noise_image(size: int = 32, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def plain(**overrides) -> MultiCropTransform:
    """Colour ops off, so the only changes are the ones under test."""
    kwargs = dict(
        global_crops_size=24,
        local_crops_size=12,
        local_crops_number=3,
        color_jitter_prob=0.0,
        grayscale_prob=0.0,
        global_blur_probs=(0.0, 0.0),
        local_blur_prob=0.0,
        global_solarize_probs=(0.0, 0.0),
        local_solarize_prob=0.0,
    )
    kwargs.update(overrides)
    return MultiCropTransform(**kwargs)


def test_crop_count_and_shapes():
    t = MultiCropTransform(global_crops_size=32, local_crops_size=16, local_crops_number=3)
    crops = t(noise_image(48))
    assert t.num_crops == 5 and len(crops) == 5
    assert [tuple(c.shape) for c in crops] == [(3, 32, 32)] * 2 + [(3, 16, 16)] * 3
    assert all(c.dtype == torch.float32 and type(c) is torch.Tensor for c in crops)


def test_defaults_are_the_reference():
    c = MultiCropTransform().config
    assert c["global_crops_size"] == 224 and c["local_crops_size"] == 96 and c["local_crops_number"] == 8
    assert c["global_crops_scale"] == (0.4, 1.0) and c["local_crops_scale"] == (0.05, 0.4)
    assert c["global_blur_probs"] == (1.0, 0.1) and c["local_blur_prob"] == 0.5
    assert c["global_solarize_probs"] == (0.0, 0.2) and c["local_solarize_prob"] == 0.0
    assert c["color_jitter"] == (0.4, 0.4, 0.2, 0.1) and c["color_jitter_prob"] == 0.8
    assert c["grayscale_prob"] == 0.2 and c["blur_radius"] == (0.1, 2.0) and c["interpolation"] == "bicubic"
    assert len(MultiCropTransform(local_crops_number=0)(noise_image(40))) == 2


def test_imagenet_normalisation_is_exact():
    crops = plain()(Image.new("RGB", (40, 40), (200, 100, 30)))
    expected = (torch.tensor([200, 100, 30]).view(3, 1, 1) / 255 - MEAN) / STD
    for crop in crops:
        torch.testing.assert_close(crop, expected.expand_as(crop), atol=1e-5, rtol=0)


def test_deterministic_under_torch_seed():
    t = MultiCropTransform(global_crops_size=32, local_crops_size=16, local_crops_number=4)
    image = noise_image(48)
    torch.manual_seed(123)
    a = t(image)
    torch.manual_seed(123)
    b = t(image)
    torch.manual_seed(124)
    c = t(image)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


def _is_solarized(crop: torch.Tensor) -> bool:
    # A uniform 200 image stays at 200 or becomes 255 - 200 = 55 when solarized (threshold 128).
    value = float((crop * STD + MEAN).mean() * 255)
    assert min(abs(value - 200), abs(value - 55)) < 1.0, value
    return abs(value - 55) < 1.0


def test_solarize_only_on_second_global_crop_by_default():
    reference = MultiCropTransform()
    # Reference solarize probabilities, colour/blur off so solarisation is the only change to the image.
    t = plain(global_solarize_probs=reference.config["global_solarize_probs"])
    image = uniform_image(200)
    hits = torch.zeros(t.num_crops)
    draws = 300
    for _ in range(draws):
        hits += torch.tensor([_is_solarized(c) for c in t(image)], dtype=torch.float)
    rate = hits / draws
    assert rate[0] == 0 and (rate[2:] == 0).all()
    assert 0.13 < rate[1] < 0.27  # p=0.2: 300 draws give 0.2 +- 0.023 (1 sd)


def test_solarize_probability_one_hits_every_crop_and_threshold_is_128():
    t = plain(global_solarize_probs=(1.0, 1.0), local_solarize_prob=1.0)
    assert all(_is_solarized(c) for c in t(uniform_image(200)))
    below = t(uniform_image(127))  # below the threshold: unchanged
    expected = (torch.full((3, 1, 1), 127 / 255) - MEAN) / STD
    for crop in below:
        torch.testing.assert_close(crop, expected.expand_as(crop), atol=1e-5, rtol=0)


def _edge_energy(crop: torch.Tensor) -> float:
    # Mean absolute horizontal difference (flip-invariant): ~0.33 in [0, 1] units for uniform noise, far less
    # once blurred with sigma >= 1.
    x = crop * STD + MEAN
    return float((x[:, :, 1:] - x[:, :, :-1]).abs().mean())


def test_blur_probabilities_per_crop():
    # scale 1 + same size: the crop is the whole image, unresampled, so only the blur smooths it.
    t = plain(
        global_crops_size=32,
        local_crops_size=32,
        global_crops_scale=(1.0, 1.0),
        local_crops_scale=(1.0, 1.0),
        local_crops_number=2,
        global_blur_probs=(1.0, 0.1),
        local_blur_prob=0.5,
        blur_radius=(1.0, 2.0),
    )
    image = noise_image(32)
    assert _edge_energy(plain(global_crops_size=32, global_crops_scale=(1.0, 1.0))(image)[0]) > 0.25
    draws = 200
    hits = torch.zeros(t.num_crops)
    for _ in range(draws):
        hits += torch.tensor([_edge_energy(c) < 0.15 for c in t(image)], dtype=torch.float)
    rate = hits / draws
    assert rate[0] == 1.0
    assert 0.03 < rate[1] < 0.19  # p=0.1, sd 0.021
    assert 0.38 < rate[2] < 0.62 and 0.38 < rate[3] < 0.62  # p=0.5, sd 0.035


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0])
def test_blur_radius_is_the_standard_deviation(sigma):
    """PIL's GaussianBlur(radius) matches a true Gaussian with sigma = radius, not another mapping."""
    image = noise_image(64, seed=1).filter(ImageFilter.GaussianBlur(1.0))  # some structure at every scale
    pil = F.pil_to_tensor(image.filter(ImageFilter.GaussianBlur(sigma))).float()
    tensor = F.pil_to_tensor(image)

    def gauss(s: float) -> torch.Tensor:
        half = math.ceil(3 * s)
        return F.gaussian_blur(tensor, kernel_size=[2 * half + 1] * 2, sigma=[s, s]).float()

    inner = (slice(None), slice(8, -8), slice(8, -8))  # borders are padded differently
    err = (pil - gauss(sigma))[inner].abs().mean()
    assert err < 1.0  # on the 0..255 scale
    for wrong in (sigma / 2, sigma * 1.5):
        assert (pil - gauss(wrong))[inner].abs().mean() > 2 * err


def test_blur_transform_on_tensors_and_tiny_images():
    blur = GaussianBlur((2.0, 2.0))
    tensor = F.pil_to_tensor(noise_image(6))  # kernel 13 would not fit: it is shortened, not an error
    out = blur(tensor)
    assert out.shape == tensor.shape and out.dtype == torch.uint8 and not torch.equal(out, tensor)
    with pytest.raises(ValueError, match="blur radius"):
        GaussianBlur((2.0, 1.0))


def test_tensor_inputs():
    t = MultiCropTransform(global_crops_size=16, local_crops_size=8, local_crops_number=1)
    uint8 = F.pil_to_tensor(noise_image(24))
    assert [c.shape[-1] for c in t(uint8)] == [16, 16, 8]
    assert [c.shape[-1] for c in t(uint8.float() / 255)] == [16, 16, 8]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(global_crops_scale=(0.5, 0.2)), "global_crops_scale"),
        (dict(local_crops_number=-1), "local_crops_number"),
        (dict(local_blur_prob=1.5), "local_blur_prob"),
        (dict(global_blur_probs=(1.0,)), "global_blur_probs"),
        (dict(global_crops_size=0), "global_crops_size"),
        (dict(interpolation="lanczos9"), "interpolation"),
    ],
)
def test_bad_parameters_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiCropTransform(**kwargs)


def test_eval_transform():
    t = eval_transform(resize_size=40, crop_size=32)
    out = t(Image.new("RGB", (80, 60), (0, 0, 0)))
    assert out.shape == (3, 32, 32)
    torch.testing.assert_close(out, ((0 - MEAN) / STD).expand(3, 32, 32), atol=1e-5, rtol=0)
    assert eval_transform(resize=40, crop=32)(noise_image(50)).shape == (3, 32, 32)
    assert eval_transform()(noise_image(50)).shape == (3, 224, 224)
    with pytest.raises(ValueError, match="crop_size 64 is larger than resize_size 32"):
        eval_transform(32, 64)


def test_describe_transform_is_stable_and_specific():
    a = describe_transform(MultiCropTransform())
    assert a == describe_transform(MultiCropTransform())
    assert a != describe_transform(MultiCropTransform(local_crops_number=6))
    e = describe_transform(eval_transform(256, 224))
    assert e == describe_transform(eval_transform(256, 224)) and "\n" not in e and "0x" not in e
    assert "256" in e and "224" in e and "BICUBIC" in e
    assert e != describe_transform(eval_transform(256, 224, interpolation="bilinear"))
    assert describe_transform(None) == "None"
