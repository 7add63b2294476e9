"""The worker half of the device path: decode (JPEG draft), random resized crops, resize, flip, uint8 out."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from ssl_xcit.data.crops import Crop, MultiCropGeometry, PlannedImage
from ssl_xcit.data.datasets import ImageDataset, load_image


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """A smooth random image with some sharp edges (JPEG-like content, not noise)."""
    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 256, (height // 32, width // 32, 3), dtype=np.uint8))
    image = np.array(small.resize((width, height), Image.BICUBIC))
    image[height // 3 : height // 2, width // 4 :: 97] = 255
    return Image.fromarray(image)


@pytest.fixture(scope="module")
def big_jpeg(tmp_path_factory):
    path = tmp_path_factory.mktemp("jpeg") / "big.jpg"
    photo(1600, 1200).save(path, quality=92)
    return path


def mean_abs(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float(
        torch.stack([(x.float() - y.float()).abs().mean() for x, y in zip(a, b, strict=True)]).mean()
    )


def test_draft_decode_is_smaller_and_within_interpolation_noise_of_a_full_decode(big_jpeg):
    geometry = dict(global_crops_size=96, local_crops_size=32, local_crops_number=6)
    drafted, full = MultiCropGeometry(**geometry), MultiCropGeometry(**geometry, draft=False)
    bilinear = MultiCropGeometry(**geometry, draft=False, interpolation="bilinear")
    differences, noise = [], []
    for seed in range(6):
        torch.manual_seed(seed)
        small = drafted.read(big_jpeg)
        torch.manual_seed(seed)
        whole = full.read(big_jpeg)
        assert small.crops == whole.crops  # the same plan: only the decode differs
        assert whole.image.size == (1600, 1200) and small.image.width <= 800  # decoded at 1/2 or less
        reference = full(whole)
        differences.append(mean_abs(drafted(small), reference))
        # Interpolation noise: the same crops of the full decode, bilinear instead of bicubic.
        noise.append(mean_abs(bilinear(whole), reference))
    assert np.mean(differences) <= np.mean(noise), (differences, noise)


def test_draft_never_upsamples_a_crop(big_jpeg):
    geometry = MultiCropGeometry(global_crops_size=224, local_crops_size=96)
    for seed in range(10):
        torch.manual_seed(seed)
        planned = geometry.read(big_jpeg)
        sx, sy = planned.scale
        for c in planned.crops:
            assert c.width * sx >= c.size and c.height * sy >= c.size


def test_small_images_and_non_jpegs_decode_in_full(tmp_path):
    photo(128, 128).save(tmp_path / "a.jpg")
    photo(800, 600).save(tmp_path / "b.png")
    geometry = MultiCropGeometry()
    assert geometry.read(tmp_path / "a.jpg").scale == (1.0, 1.0)
    assert geometry.read(tmp_path / "b.png").scale == (1.0, 1.0)


def test_exif_rotated_photo_is_cropped_upright(tmp_path):
    path = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees: the upright image is 600 wide, 800 high
    photo(800, 600).save(path, exif=exif, quality=95)
    geometry = MultiCropGeometry(global_crops_size=64, local_crops_size=32, local_crops_number=2, draft=False)
    torch.manual_seed(0)
    planned = geometry.read(path)
    assert planned.image.size == (600, 800)
    assert all(c.left + c.width <= 600 and c.top + c.height <= 800 for c in planned.crops)
    upright = load_image(path)
    same_plan = geometry(PlannedImage(upright, planned.crops, (1.0, 1.0)))
    assert all(torch.equal(a, b) for a, b in zip(geometry(planned), same_plan, strict=True))


def test_crop_equals_torchvisions_resized_crop_and_flip_within_rounding():
    image = photo(320, 256)
    geometry = MultiCropGeometry(global_crops_size=64, local_crops_number=0)
    crops = [Crop(10, 20, 150, 200, 64, False), Crop(0, 0, 256, 256, 64, True)]
    got = geometry(PlannedImage(image, crops, (1.0, 1.0)))
    for c, out in zip(crops, got, strict=True):
        want = F.resized_crop(
            image, c.top, c.left, c.height, c.width, [c.size, c.size], F.InterpolationMode.BICUBIC
        )
        if c.flip:
            want = F.horizontal_flip(want)
        want = torch.from_numpy(np.array(want)).permute(2, 0, 1)
        assert out.dtype == torch.uint8 and out.shape == (3, 64, 64)
        # Resizing with a box reads the pixels just outside it where crop-then-resize clamps: edges only.
        assert (out.float() - want.float()).abs().mean() < 1.0


def test_dataset_uses_the_geometry_reader_and_flags_unreadable_files(tmp_path):
    photo(96, 96).save(tmp_path / "ok.jpg")
    (tmp_path / "bad.jpg").write_bytes(b"not a jpeg")
    geometry = MultiCropGeometry(global_crops_size=32, local_crops_size=16, local_crops_number=2)
    dataset = ImageDataset([(tmp_path / "ok.jpg", 0), (tmp_path / "bad.jpg", 0)], ["x"], geometry)
    crops, label, index = dataset[0]
    assert [tuple(c.shape) for c in crops] == [(3, 32, 32)] * 2 + [(3, 16, 16)] * 2
    assert all(c.dtype == torch.uint8 for c in crops)
    with pytest.warns(UserWarning, match="bad.jpg"):
        assert dataset[1] is None
    assert dataset.num_skipped == 1


def test_bad_geometry_options_name_the_value():
    with pytest.raises(ValueError, match="local_crops_number.*-1"):
        MultiCropGeometry(local_crops_number=-1)
    with pytest.raises(ValueError, match="global_crops_scale"):
        MultiCropGeometry(global_crops_scale=(0.5, 1.5))
