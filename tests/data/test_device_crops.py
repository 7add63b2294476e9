"""Crops on the device (``ssl_xcit.data.device_crops``): faithful to the PIL path, same box distributions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.ops import roi_align

from ssl_xcit.data.crops import MultiCropGeometry
from ssl_xcit.data.datamodule import DINODataModule
from ssl_xcit.data.datasets import EmptyBatch, ImageDataset
from ssl_xcit.data.device_crops import CropReader, collate_crops, cut_crops, decode_batch
from ssl_xcit.data.transforms import MultiCropTransform
from ssl_xcit.errors import UserError


def mean_abs(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float(np.mean([(x.float() - y.float()).abs().mean() for x, y in zip(a, b, strict=True)]))


def device_crops(reader: CropReader, items: list) -> list[torch.Tensor]:
    batch = collate_crops([(it, 0, i) for i, it in enumerate(items)])[0]
    return cut_crops(decode_batch(batch, torch.device("cpu")), batch.rois, batch.flips, reader.sizes)


@pytest.mark.parametrize("dataset,every", [("flowers5", 430), ("retrieval_mini/ukbench", 1)])
def test_device_crops_stay_within_interpolation_noise_of_the_pil_path(shared_data, dataset, every):
    # The same boxes cut by PIL (bicubic, the CPU path) and by roi_align on a padded batch. Interpolation noise
    # is the gap between two accepted filters on the same boxes: PIL bilinear vs PIL bicubic. roi_align is a
    # bilinear sampler averaging ceil(box / output) samples per pixel, so it may differ from bicubic by about
    # that much: allowed 1.5x of it on average. Measured: flowers5 (128 px, mostly upsampled) 0.35 vs 0.32
    # grey levels, UKBench (640x480, downsampled) 1.38 vs 1.97.
    files = sorted((shared_data / dataset).rglob("*.jpg"))[::every][:6]
    assert len(files) == 6
    pil, bilinear = MultiCropGeometry(draft=False), MultiCropGeometry(draft=False, interpolation="bilinear")
    reader = CropReader(MultiCropGeometry(draft=False))
    planned, items = [], []
    for seed, path in enumerate(files):
        torch.manual_seed(seed)
        planned.append(pil.read(path))
        torch.manual_seed(seed)
        items.append(reader.read(path))
    cut = device_crops(reader, items)  # one padded batch of the 6 images (sizes differ in flowers5)
    differences, noise = [], []
    for b, image in enumerate(planned):
        reference = pil(image)
        differences.append(mean_abs([c[b] for c in cut], reference))
        noise.append(mean_abs(bilinear(image), reference))
    assert np.mean(differences) <= 1.5 * np.mean(noise), (differences, noise)
    assert max(differences) < 3.0  # grey levels: no crop is misplaced or flipped the wrong way


def test_padding_repeats_the_edge_so_padded_crops_equal_unpadded_ones():
    rng = np.random.default_rng(0)
    shapes = [(3, 37, 50), (3, 60, 29), (3, 41, 41)]
    images = [torch.from_numpy(rng.integers(0, 256, s, dtype=np.uint8)) for s in shapes]
    # Boxes touching the right and bottom borders, where zero padding would darken the samples.
    boxes = [np.array([[w - 20.0, h - 15.0, w, h], [0.0, 0.0, w, h]], dtype=np.float32) for _, h, w in shapes]

    class Item:
        encoded, fallback = False, False

    items = []
    for image, box in zip(images, boxes, strict=True):
        it = Item()
        it.data, it.boxes, it.flips, it.size = image, box, np.array([False, True]), tuple(image.shape[-2:])
        items.append((it, 0, 0))
    batch = collate_crops(items)[0]
    padded = cut_crops(batch.images, batch.rois, batch.flips, [12, 12])
    for b, (image, box) in enumerate(zip(images, boxes, strict=True)):
        alone = roi_align(image[None].float(), [torch.from_numpy(box)], 12, 1.0, -1, True)
        alone[1] = alone[1].flip(-1)
        assert torch.equal(padded[0][b], alone[0].round().clamp(0, 255).to(torch.uint8))
        assert torch.equal(padded[1][b], alone[1].round().clamp(0, 255).to(torch.uint8))


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic (largest gap between the empirical CDFs)."""
    grid = np.concatenate([a, b])
    cdf = lambda x: np.searchsorted(np.sort(x), grid, side="right") / x.size  # noqa: E731
    return float(np.abs(cdf(a) - cdf(b)).max())


def test_box_scale_ratio_and_flip_distributions_equal_the_cpu_paths(tmp_path):
    # 640x480 (full decode) and 1600x1200 (drafted to 1/2 or less: boxes are rescaled) photos.
    for name, size in (("a.jpg", (640, 480)), ("b.jpg", (1600, 1200))):
        Image.new("RGB", size, (90, 120, 30)).save(tmp_path / name)
    reader = CropReader(MultiCropGeometry())
    cpu = MultiCropTransform()
    global_rrc = cpu.global_transforms[0].transforms[0]
    local_rrc = cpu.local_transform.transforms[0]
    flip_p = cpu.global_transforms[0].transforms[1].p
    torch.manual_seed(0)
    ours: dict[str, list] = {"global": [], "local": []}
    flips = []
    for i in range(600):
        item = reader.read(tmp_path / ("a.jpg" if i % 2 else "b.jpg"))
        h, w = item.size
        width, height = item.boxes[:, 2] - item.boxes[:, 0], item.boxes[:, 3] - item.boxes[:, 1]
        stats = np.stack([width * height / (w * h), np.log(width / height)], 1)
        ours["global"] += list(stats[:2])
        ours["local"] += list(stats[2:])
        flips += list(item.flips)
    torch.manual_seed(1)
    theirs: dict[str, list] = {"global": [], "local": []}
    image = Image.new("RGB", (640, 480))
    for kind, rrc, count in (("global", global_rrc, 1200), ("local", local_rrc, 4800)):
        for _ in range(count):
            p = rrc.make_params([image])
            theirs[kind].append((p["width"] * p["height"] / (640 * 480), np.log(p["width"] / p["height"])))
    for kind in ("global", "local"):
        a, b = np.array(ours[kind]), np.array(theirs[kind])
        # KS critical value at alpha = 0.001: 1.95 * sqrt((n + m) / (n m)); integer box sides on two image
        # sizes differ from 640x480's by at most 1 px per side, far below that.
        critical = 1.95 * np.sqrt((len(a) + len(b)) / (len(a) * len(b)))
        for column, what in ((0, "scale"), (1, "log ratio")):
            assert ks_statistic(a[:, column], b[:, column]) < critical, (kind, what)
    # Flips: a binomial with p = 0.5 over 6,000 crops has sd 0.0065; 4 sd.
    assert abs(np.mean(flips) - flip_p) < 4 * np.sqrt(flip_p * (1 - flip_p) / len(flips))


def test_decode_on_device_gives_the_workers_pixels_and_boxes(shared_data):
    files = sorted((shared_data / "retrieval_mini" / "ukbench").rglob("*.jpg"))[:3]
    worker, device = (CropReader(MultiCropGeometry(), mode) for mode in ("worker", "device"))
    items = {}
    for reader in (worker, device):
        torch.manual_seed(0)
        items[reader.decode_on] = [reader.read(f) for f in files]
    assert all(it.encoded for it in items["device"]) and not any(it.encoded for it in items["worker"])
    for a, b in zip(items["worker"], items["device"], strict=True):
        assert np.array_equal(a.boxes, b.boxes) and np.array_equal(a.flips, b.flips)  # 640x480: no draft
    for a, b in zip(
        device_crops(worker, items["worker"]), device_crops(device, items["device"]), strict=True
    ):
        assert torch.equal(a, b)  # both libjpeg-turbo through torchvision, on this CPU


def test_files_the_batched_decoder_may_refuse_are_decoded_in_the_worker_and_counted(tmp_path):
    rng = np.random.default_rng(0)
    for i, (fmt, mode) in enumerate((("JPEG", "RGB"), ("PNG", "RGB"), ("JPEG", "CMYK"), ("JPEG", "RGB"))):
        pixels = Image.fromarray(rng.integers(0, 256, (30 + i, 40, 3), dtype=np.uint8)).convert(mode)
        pixels.save(tmp_path / f"{i}.{'png' if fmt == 'PNG' else 'jpg'}", fmt)
    dm = DINODataModule(
        root=str(tmp_path), batch_size=4, augment_on="device", decode_on="device", num_workers=0,
        global_crops_size=16, local_crops_size=8, local_crops_number=2,
    )  # fmt: skip
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert len(batch[0].encoded) == 2 and batch[0].images.shape[0] == 2 and batch[0].fallbacks == 2
    out = dm.on_after_batch_transfer(batch, 0)
    assert [tuple(c.shape) for c in out[0]] == [(4, 3, 16, 16)] * 2 + [(4, 3, 8, 8)] * 2
    assert dm.decode_fallbacks == 2


def test_exif_rotated_photo_is_cropped_upright_as_the_pil_path(tmp_path):
    image = Image.new("RGB", (300, 100), (200, 10, 10))
    image.paste((10, 10, 200), (0, 0, 150, 100))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    image.save(tmp_path / "r.jpg", exif=exif)
    pil, reader = MultiCropGeometry(draft=False), CropReader(MultiCropGeometry(draft=False), "device")
    torch.manual_seed(3)
    planned = pil.read(tmp_path / "r.jpg")
    torch.manual_seed(3)
    item = reader.read(tmp_path / "r.jpg")
    assert not item.encoded and item.fallback and item.size == (300, 100)  # upright, decoded in the worker
    assert mean_abs([c[0] for c in device_crops(reader, [item])], pil(planned)) < 3.0


def test_unreadable_files_are_dropped_and_bad_decode_on_is_named(tmp_path):
    (tmp_path / "bad.jpg").write_bytes(b"not a jpeg")
    dataset = ImageDataset([(tmp_path / "bad.jpg", -1)], None, CropReader(MultiCropGeometry()))
    with pytest.warns(UserWarning, match="unreadable"):
        assert isinstance(collate_crops([dataset[0]]), EmptyBatch)
    with pytest.raises(UserError, match="'gpu'"):
        DINODataModule(augment_on="device", decode_on="gpu")
    with pytest.raises(UserError, match="'gpu'"):
        CropReader(MultiCropGeometry(), "gpu")


def test_repeated_reads_with_one_seed_repeat(shared_data):
    path = next(Path(shared_data / "flowers5").rglob("*.jpg"))
    reader = CropReader(MultiCropGeometry())
    torch.manual_seed(7)
    first = reader.read(path)
    torch.manual_seed(7)
    again = reader.read(path)
    assert np.array_equal(first.boxes, again.boxes) and torch.equal(first.data, again.data)


def test_the_fallback_count_is_logged_with_decode_on_device(tmp_path):
    from ssl_xcit.data.datamodule import SkippedImagesLogger

    logged = {}

    class Module:
        def log(self, name, value, **kwargs):
            logged[name] = value

    class Trainer:
        datamodule = DINODataModule(augment_on="device", decode_on="device")

    Trainer.datamodule._use_augment_on("device")
    Trainer.datamodule.decode_fallbacks = 3
    SkippedImagesLogger().on_train_epoch_end(Trainer(), Module())
    assert logged == {"data/skipped_images": 0.0, "data/cpu_decoded_images": 3.0}


@pytest.mark.parametrize("cpu_refuses", [False, True], ids=["libjpeg-turbo", "pil"])
def test_a_file_the_device_decoder_refuses_is_decoded_on_the_cpu_and_counted(
    tmp_path, monkeypatch, cpu_refuses
):
    """nvJPEG refuses a whole batched call for one file. Here the device decoder refuses file 1 (alone or in a
    list); with ``cpu_refuses`` libjpeg-turbo refuses it on the CPU too, leaving PIL. The batch decodes to the
    same pixels as an unrefused decode, the file is counted, and the run goes on."""
    import ssl_xcit.data.device_crops as device_crops_module

    rng = np.random.default_rng(1)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (24 + i, 32, 3), dtype=np.uint8)).save(tmp_path / f"{i}.jpg")
    dm = DINODataModule(
        root=str(tmp_path), batch_size=3, augment_on="device", decode_on="device", num_workers=0,
        global_crops_size=16, local_crops_size=8, local_crops_number=2,
    )  # fmt: skip
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert len(batch[0].encoded) == 3 and batch[0].fallbacks == 0
    expected = decode_batch(batch[0], torch.device("cpu"))
    assert batch[0].fallbacks == 0
    refused = batch[0].encoded[1]
    real = device_crops_module.decode_jpeg
    calls = []

    def refusing(data, *args, device=None, **kwargs):
        files = data if isinstance(data, list) else [data]
        calls.append((len(files), device))
        if any(f is refused for f in files) and (device is not None or cpu_refuses):
            raise RuntimeError("nvjpegDecodeBatched failed: NVJPEG_STATUS_BAD_JPEG")
        return real(data, *args, **({} if device is None else {"device": device}), **kwargs)

    monkeypatch.setattr(device_crops_module, "decode_jpeg", refusing)
    out = dm.on_after_batch_transfer(batch, 0)
    assert [tuple(c.shape) for c in out[0]] == [(3, 3, 16, 16)] * 2 + [(3, 3, 8, 8)] * 2
    assert dm.decode_fallbacks == 1 and batch[0].fallbacks == 1
    # One batched call, then one per file on the device, with the CPU's libjpeg-turbo for the refused one.
    cpu = torch.device("cpu")
    assert calls == [(3, cpu), (1, cpu), (1, cpu), (1, None), (1, cpu)]
    torch.testing.assert_close(decode_batch(batch[0], torch.device("cpu")), expected, rtol=0, atol=0)
    assert batch[0].fallbacks == 2  # decoded again, counted again
