"""The Gram teacher's crops (DINOv3's ``gram_teacher_no_distortions``), on the CPU path (``MultiCropTransform``) and
the device path (``MultiCropGeometry`` boxes, ``cut_crops`` on the device, ``augment_batch``): the global crop's
box and flip at ``gram_crops_size``, with no photometric distortion, only normalised.

The boxes are compared through a ramp image (red = 2 x column, green = 2.5 x row): every resampler here (PIL's
anti-aliased bicubic, roi_align's averaging) keeps a linear image linear away from the image's border, so a crop
of a box shows that box's coordinates, and the 2 x 2 means of a crop at twice the side equal the crop at the
side wherever both come from one box and one flip.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as nnf
from PIL import Image
from torchvision.transforms import RandomResizedCrop
from torchvision.transforms.v2 import functional as F

from ssl_xcit.data.crops import MultiCropGeometry
from ssl_xcit.data.device_augment import PhotometricAugment
from ssl_xcit.data.device_crops import CropReader, collate_crops
from ssl_xcit.data.transfer import augment_batch
from ssl_xcit.data.transforms import IMAGENET_MEAN, IMAGENET_STD, MultiCropTransform

SIZES = dict(global_crops_size=32, local_crops_size=16, local_crops_number=2)
NO_DISTORTION = dict(
    color_jitter_prob=0.0, grayscale_prob=0.0, global_blur_probs=(0.0, 0.0), local_blur_prob=0.0,
    global_solarize_probs=(0.0, 0.0),
)  # fmt: skip
EVERY_DISTORTION = dict(
    color_jitter_prob=1.0, grayscale_prob=1.0, global_blur_probs=(1.0, 1.0), local_blur_prob=1.0,
    global_solarize_probs=(1.0, 1.0),
)  # fmt: skip
MEAN = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
STD = torch.tensor(IMAGENET_STD).view(3, 1, 1)


def ramp(width: int = 120, height: int = 100) -> Image.Image:
    y, x = np.mgrid[:height, :width]
    return Image.fromarray(np.stack([2 * x, 2.5 * y, np.full_like(x, 128)], -1).astype(np.uint8))


def grey_levels(crop: torch.Tensor) -> torch.Tensor:
    """A normalised crop (..., 3, H, W) back on the 0..255 scale."""
    return (crop * STD + MEAN) * 255


def assert_same_box(global_crop: torch.Tensor, gram_crop: torch.Tensor) -> None:
    """2 x 2 means of the Gram crop equal the global crop inside (2 px margin), within the uint8 rounding of
    both; a box one pixel off shifts the ramp by 2 levels or more."""
    pooled = nnf.avg_pool2d(grey_levels(gram_crop)[None], 2)[0]
    diff = (pooled - grey_levels(global_crop))[:2, 2:-2, 2:-2].abs()
    assert float(diff.max()) < 1.1


# ------------------------------------------------------------------------------------------- CPU path
def test_cpu_gram_crops_have_the_global_boxes_and_flips_and_shapes():
    image = ramp()
    off = MultiCropTransform(**SIZES, **NO_DISTORTION)
    on = MultiCropTransform(**SIZES, **NO_DISTORTION, gram_crops_size=64)
    for seed in range(6):  # both flips met
        torch.manual_seed(seed)
        out = on(image)
        torch.manual_seed(seed)
        plain = off(image)
        assert [tuple(c.shape) for c in out["crops"]] == [(3, 32, 32)] * 2 + [(3, 16, 16)] * 2
        assert [tuple(c.shape) for c in out["gram_crops"]] == [(3, 64, 64)] * 2
        for got, want in zip(out["crops"], plain, strict=True):  # the Gram crops draw nothing
            assert torch.equal(got, want)
        for k in range(2):
            assert_same_box(out["crops"][k], out["gram_crops"][k])


def test_cpu_gram_crop_is_the_clean_crop_of_the_first_draws():
    """With every distortion at probability 1, Gram crop 1 is exactly the box and flip torchvision draws first
    from the seed, resampled and normalised, nothing else; the global crop of that box is distorted."""
    image = ramp()
    transform = MultiCropTransform(**SIZES, **EVERY_DISTORTION, gram_crops_size=64)
    for seed in range(4):
        torch.manual_seed(seed)
        out = transform(image)
        torch.manual_seed(seed)
        top, left, h, w = RandomResizedCrop.get_params(image, [0.4, 1.0], [3 / 4, 4 / 3])
        flip = bool(torch.rand(1) < 0.5)

        def clean(size, box=(top, left, h, w), flip=flip):
            crop = F.resized_crop(image, *box, [size, size], interpolation=F.InterpolationMode.BICUBIC)
            crop = F.horizontal_flip(crop) if flip else crop
            return (F.pil_to_tensor(crop).float() / 255 - MEAN) / STD

        torch.testing.assert_close(out["gram_crops"][0], clean(64), rtol=0, atol=1e-6)
        assert float((out["crops"][0] - clean(32)).abs().max()) > 0.5  # distorted


# ---------------------------------------------------------------------------------------- device path
def test_device_plan_gives_the_gram_crops_the_global_boxes():
    geometry = MultiCropGeometry(**SIZES, gram_crops_size=64)
    torch.manual_seed(0)
    crops = geometry.plan(120, 100)
    torch.manual_seed(0)
    plain = MultiCropGeometry(**SIZES).plan(120, 100)
    assert crops[:4] == plain and len(crops) == 6  # the Gram crops draw nothing
    for g, gram in zip(crops[:2], crops[4:], strict=True):
        assert (gram.top, gram.left, gram.height, gram.width, gram.flip) == (
            g.top,
            g.left,
            g.height,
            g.width,
            g.flip,
        )
        assert gram.size == 64
    assert CropReader(geometry).sizes == [32, 32, 16, 16, 64, 64]


def _device_batch(paths, seed, decode_on, **photometric):
    reader = CropReader(MultiCropGeometry(**SIZES, gram_crops_size=64), decode_on)
    torch.manual_seed(seed)
    batch = collate_crops([(reader.read(p), 0, i) for i, p in enumerate(paths)])
    augment = PhotometricAugment(**photometric)
    out, _ = augment_batch(batch, reader, augment, lambda: np.random.default_rng(seed), None)
    return out[0]


@pytest.mark.parametrize("decode_on", ["worker", "device"])
def test_device_gram_crops_same_box_no_distortion_and_shapes(tmp_path, decode_on):
    paths = []
    for i, size in enumerate([(120, 100), (90, 110)]):
        paths.append(tmp_path / f"{i}.jpg")
        ramp(*size).save(paths[-1], quality=98)
    for seed in range(3):
        clean = _device_batch(paths, seed, decode_on, **NO_DISTORTION)
        assert [tuple(c.shape) for c in clean["crops"]] == [(2, 3, 32, 32)] * 2 + [(2, 3, 16, 16)] * 2
        assert [tuple(c.shape) for c in clean["gram_crops"]] == [(2, 3, 64, 64)] * 2
        for k in range(2):
            for b in range(2):
                assert_same_box(clean["crops"][k][b], clean["gram_crops"][k][b])
        distorted = _device_batch(paths, seed, decode_on, **EVERY_DISTORTION)
        for k in range(2):  # the same Gram crops whatever the photometric settings; other global crops
            assert torch.equal(distorted["gram_crops"][k], clean["gram_crops"][k])
            assert float((distorted["crops"][k] - clean["crops"][k]).abs().max()) > 0.5


def test_cpu_and_device_paths_cut_the_same_gram_crop(tmp_path):
    """One seed draws global crop 1's box and flip first on both paths: their Gram crops agree inside (the
    resamplers agree on the ramp), so the two paths give the Gram teacher the same box."""
    image = ramp()
    image.save(tmp_path / "ramp.png")
    cpu = MultiCropTransform(**SIZES, gram_crops_size=64)
    for seed in range(4):
        torch.manual_seed(seed)
        on_cpu = cpu(image)["gram_crops"][0]
        on_device = _device_batch([tmp_path / "ramp.png"], seed, "worker")["gram_crops"][0][0]
        diff = (grey_levels(on_cpu) - grey_levels(on_device))[:2, 4:-4, 4:-4].abs()
        assert float(diff.max()) < 1.1
