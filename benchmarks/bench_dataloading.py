"""Data-loading throughput of DINO multi-crop per DataLoader worker: four paths side by side in one run.

- "CPU path" is ``augment_on=cpu``: every worker decodes and runs DINO's whole PIL augmentation (the
  reference's pipeline), delivering float crops;
- "worker crops" is the previous worker half of ``augment_on=device`` (``MultiCropGeometry``): decode (JPEG
  ``draft`` when the crops allow it), random resized crops, resize and flip in PIL, uint8 crops;
- "device crops, decode in worker" is today's ``augment_on=device``: the worker decodes and draws the crop boxes
  and flips, and the crops are cut on the training device (``ssl_xcit.data.device_crops``);
- "device crops, decode on device" is ``--data.decode_on device``: the worker reads the bytes and draws boxes.

All are timed on the same files at 2x224 + 8x96 and 2x224 + 10x96 crops, with each path's ratio to the CPU
path. The device half (decode on device, roi_align crops, photometric half) is timed on this CPU as well, per
image on one thread: on a CPU-only trainer that work moves into the training process.

Run from the repository root (the datasets are read from ../shared/data):

    python benchmarks/bench_dataloading.py
    python benchmarks/bench_dataloading.py --datasets flowers5 --workers 0 --num-images 96 --repeats 3
    python benchmarks/bench_dataloading.py --ci --compare-augment --compare-decoders

Datasets: ``flowers5`` (128 x 128 JPEGs), ``ukbench`` (the 640 x 480 UKBench JPEGs of retrieval_mini, the size
of an average ImageNet image, repeated to ``--photo-files`` files in a temporary folder), ``holidays`` (the 8 MP
Holidays photos, repeated likewise), ``synthetic`` (the built-in PNGs). ``--ci`` is a few-second smoke run on
small synthetic JPEGs. num_workers=0 decodes in the main process (counted as one worker). Timing starts after
the first batch, so worker start-up is excluded; the median of ``--repeats`` runs is printed. Torch uses one
intra-op thread, as in DataLoader workers.

``--compare-augment`` times the device half on this CPU: our batched per-sample kernels, torchvision's v2
functional ops looped per sample, and kornia's augmentation module (if installed). ``--compare-decoders`` times
JPEG decoders on the photos: PIL at full size and with ``draft``, torchvision's ``decode_jpeg``, simplejpeg and
PyTurboJPEG (if installed). ``--compare-padding`` times device crops of mixed-size images on one padded batch
against buckets of equal size.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

from ssl_xcit.data.crops import MultiCropGeometry
from ssl_xcit.data.datasets import ImageDataset, build_dataset, collate_skip_none, load_image
from ssl_xcit.data.device_augment import PhotometricAugment
from ssl_xcit.data.device_crops import CropBatch, CropReader, collate_crops, cut_crops, decode_batch, pad_into
from ssl_xcit.data.synthetic import ensure_synthetic_dataset
from ssl_xcit.data.transforms import GaussianBlur, MultiCropTransform

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SSL_XCIT_SHARED_DATA") or REPO_ROOT.parent / "shared" / "data")


def repeated_photos(source: Path, count: int, workdir: Path) -> Path | None:
    """A folder of ``count`` links to the JPEGs under ``source`` (cycled), or None without the source."""
    files = sorted(source.rglob("*.jpg")) if source.is_dir() else []
    if not files:
        return None
    folder = workdir / source.name
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        link = folder / f"{i:05d}.jpg"
        if not link.exists():
            link.symlink_to(files[i % len(files)].resolve())
    return folder


def ci_images(workdir: Path, count: int = 48) -> Path:
    """Small photo-like JPEGs (smooth random colours) for the CI-size run."""
    folder = workdir / "ci"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        small = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8))
        small.resize((160, 120), Image.BICUBIC).save(folder / f"{i:03d}.jpg", quality=90)
    return folder


def dataset_root(name: str, workdir: Path, photo_files: int) -> Path | None:
    if name == "flowers5":
        path = SHARED / "flowers5"
        return path if path.is_dir() else None
    if name in ("ukbench", "holidays"):
        return repeated_photos(SHARED / "retrieval_mini" / name, photo_files, workdir)
    if name == "ci":
        return ci_images(workdir)
    return ensure_synthetic_dataset() / "train"


def batch_size_of(batch: list) -> int:
    crops = batch[0]
    return crops.batch_size if isinstance(crops, CropBatch) else crops[0].shape[0]


def loader_rate(dataset: ImageDataset, workers: int, batch_size: int, num_images: int, seed: int) -> float:
    """Images/s after the first batch, until ``num_images`` more have been delivered."""
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=generator,
        num_workers=workers,
        collate_fn=collate_crops if isinstance(dataset.transform, CropReader) else collate_skip_none,
        drop_last=True,
    )
    iterator = iter(loader)
    next(iterator)  # worker start-up and the first decode are not counted
    start, seen = time.perf_counter(), 0
    while seen < num_images:
        try:
            batch = next(iterator)
        except StopIteration:
            iterator = iter(loader)
            continue
        seen += batch_size_of(batch)
    rate = seen / (time.perf_counter() - start)
    del iterator
    return rate


PATHS = (
    "CPU path (augment_on=cpu)",
    "worker crops (previous device path)",
    "device crops, decode in worker",
    "device crops, decode on device",
)


def device_crop_time(dataset: ImageDataset, args: argparse.Namespace) -> float:
    """Milliseconds per image of the device half on this CPU: decode (bytes only), crops, photometric half."""
    reader = dataset.transform
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, collate_fn=collate_crops)
    batch = next(iter(loader))[0]
    augment, cpu = PhotometricAugment(), torch.device("cpu")
    times = []
    for r in range(args.repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        images = decode_batch(batch, cpu)
        augment(cut_crops(images, batch.rois, batch.flips, reader.sizes), np.random.default_rng(r))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) / batch.batch_size * 1e3


def compare_paths(args: argparse.Namespace, name: str, root: Path) -> list[tuple]:
    """Per-worker images/s of the four paths, per crop setting and worker count, and the device half's time."""
    rows = []
    for local_number in args.local_numbers:
        geometry = dict(
            global_crops_size=args.global_size,
            local_crops_size=args.local_size,
            local_crops_number=local_number,
        )
        transforms = (
            MultiCropTransform(**geometry),
            MultiCropGeometry(**geometry),
            CropReader(MultiCropGeometry(**geometry), "worker"),
            CropReader(MultiCropGeometry(**geometry), "device"),
        )
        setting = f"2x{args.global_size} + {local_number}x{args.local_size}"
        for workers in args.workers:
            rates = []
            for label, transform in zip(PATHS, transforms, strict=True):
                dataset = build_dataset(root, transform=transform)
                runs = [
                    loader_rate(dataset, workers, args.batch_size, args.num_images, seed=r)
                    for r in range(args.repeats)
                ]
                rates.append(statistics.median(runs) / max(workers, 1))
                print(
                    f"  {setting}, num_workers={workers}: {label:38s} {rates[-1]:7.1f} images/s per worker, "
                    f"x{rates[-1] / rates[0]:.2f} the CPU path (runs: {', '.join(f'{r:.1f}' for r in runs)})"
                )
            rows.append((f"{name} {setting} w{workers}", *rates))
        for transform in transforms[2:]:
            ms = device_crop_time(build_dataset(root, transform=transform), args)
            print(
                f"  {setting}: device half on this CPU (1 thread), decode_on={transform.decode_on}: "
                f"{ms:.2f} ms per image"
            )
    return rows


def device_half_rate(args: argparse.Namespace, batch: int = 16) -> None:
    """Images/s of the photometric half on this CPU (one thread): ours, torchvision per sample, kornia."""
    torch.manual_seed(0)
    n_local = args.local_numbers[0]
    crops = [torch.randint(0, 256, (batch, 3, args.global_size, args.global_size), dtype=torch.uint8)] * 2
    crops += [
        torch.randint(0, 256, (batch, 3, args.local_size, args.local_size), dtype=torch.uint8)
    ] * n_local
    ours = PhotometricAugment()
    generator = torch.Generator().manual_seed(0)

    def ours_call() -> None:
        ours(crops, generator)

    jitter = v2.ColorJitter(0.4, 0.4, 0.2, 0.1)
    blur, gray = GaussianBlur((0.1, 2.0)), v2.RandomGrayscale(0.2)
    normalize = v2.Normalize(ours.mean, ours.std)

    def torchvision_call() -> None:
        # v2 functional ops take one parameter set per call: a Python loop over the samples.
        for k, c in enumerate(crops):
            p_blur, p_sol = ours.crop_probs(k)
            for image in c.float().div(255):
                image = jitter(image) if torch.rand(1) < 0.8 else image
                image = gray(image)
                image = blur(image) if torch.rand(1) < p_blur else image
                image = v2.functional.solarize(image, 0.5) if torch.rand(1) < p_sol else image
                normalize(image)

    candidates: dict[str, Callable[[], None]] = {
        "ours (batched, per-sample params)": ours_call,
        "torchvision v2, loop per sample": torchvision_call,
    }
    try:
        import kornia.augmentation as K

        def kornia_pipeline(p_blur: float, p_sol: float):
            return K.AugmentationSequential(
                K.ColorJitter(0.4, 0.4, 0.2, 0.1, p=0.8),
                K.RandomGrayscale(p=0.2),
                K.RandomGaussianBlur((13, 13), (0.1, 2.0), p=p_blur),
                K.RandomSolarize(thresholds=0.0, additions=0.0, p=p_sol),
                K.Normalize(torch.tensor(ours.mean), torch.tensor(ours.std)),
            )

        pipelines = [kornia_pipeline(*ours.crop_probs(k)) for k in range(len(crops))]

        def kornia_call() -> None:
            for pipeline, c in zip(pipelines, crops, strict=True):
                pipeline(c.float().div(255))

        candidates["kornia.augmentation (per-batch jitter order)"] = kornia_call
    except ImportError:
        print("  kornia not installed: its row is skipped (pip install kornia)")
    rates = {}
    for label, call in candidates.items():
        call()  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        rates[label] = batch / statistics.median(times)
        print(f"  device half on CPU, {label:48s} {rates[label]:7.1f} images/s (1 thread)")
    base = rates["ours (batched, per-sample params)"]
    for label, rate in rates.items():
        print(f"  ratio ours / {label}: {base / rate:.2f}x")


def compare_decoders(args: argparse.Namespace, workdir: Path) -> None:
    """Full-image decode rates of the photo JPEGs: PIL, PIL draft at 1/2, 1/4, 1/8, simplejpeg, PyTurboJPEG."""
    for name in ("ukbench", "holidays"):
        root = dataset_root(name, workdir, 8)
        if root is None:
            print(f"decoders, {name}: not found under {SHARED / 'retrieval_mini'}, skipped")
            continue
        time_decoders(name, sorted(root.glob("*.jpg"))[:8], args.repeats)


def time_decoders(name: str, files: list[Path], repeats: int) -> None:
    blobs = [f.read_bytes() for f in files]
    width, height = Image.open(files[0]).size
    decoders: dict[str, Callable[[int], object]] = {"PIL full": lambda i: load_image(files[i]).size}
    tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
    decoders["torchvision decode_jpeg"] = lambda i: decode_jpeg(tensors[i], mode=ImageReadMode.RGB)
    for scale in (2, 4, 8):
        decoders[f"PIL draft 1/{scale}"] = lambda i, s=scale: load_image(
            files[i], draft=(width // s, height // s)
        )
    try:
        import simplejpeg

        decoders["simplejpeg full"] = lambda i: simplejpeg.decode_jpeg(blobs[i], colorspace="RGB")
        decoders["simplejpeg 1/4"] = lambda i: simplejpeg.decode_jpeg(
            blobs[i], colorspace="RGB", min_width=width // 4, min_height=height // 4
        )
    except ImportError:
        print("  simplejpeg not installed (pip install simplejpeg)")
    try:
        from turbojpeg import TurboJPEG

        jpeg = TurboJPEG()
        decoders["PyTurboJPEG full"] = lambda i: jpeg.decode(blobs[i])
    except (ImportError, RuntimeError, OSError) as err:
        print(f"  PyTurboJPEG unavailable ({type(err).__name__}: needs libturbojpeg)")
    rates = {}
    for label, decode in decoders.items():
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            for i in range(len(files)):
                decode(i)
            runs.append(len(files) / (time.perf_counter() - start))
        rates[label] = statistics.median(runs)
    base = rates["PIL full"]
    for label, rate in rates.items():
        print(
            f"decoders, {name} ({width}x{height}): {label:18s} {rate:8.1f} images/s, x{rate / base:.2f} PIL"
        )


def compare_padding(args: argparse.Namespace, batch: int = 16) -> None:
    """Device crops of a batch of mixed-orientation 640x480 images: one padded batch (one roi_align call per
    crop size) against buckets of equal size (one call per size and bucket), ms per image on one thread."""
    rng = np.random.default_rng(0)
    shapes = [(480, 640) if b % 2 else (640, 480) for b in range(batch)]
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8) for h, w in shapes]
    sizes = [args.global_size] * 2 + [args.local_size] * args.local_numbers[0]
    boxes = []
    for h, w in shapes:
        side = rng.uniform(0.2, 0.9, len(sizes))
        x, y = rng.uniform(0, 1 - side) * w, rng.uniform(0, 1 - side) * h
        boxes.append(np.stack([x, y, x + side * w, y + side * h], 1).astype(np.float32))

    def cut(members: list[int]) -> None:
        stacked = np.stack([boxes[b] for b in members], 1)  # (K, n, 4), crop-major as collate_crops
        rows = np.tile(np.arange(len(members), dtype=np.float32), len(sizes))[:, None]
        rois = torch.from_numpy(np.concatenate([rows, stacked.reshape(-1, 4)], 1))
        height, width = max(shapes[b][0] for b in members), max(shapes[b][1] for b in members)
        padded = torch.empty((len(members), 3, height, width), dtype=torch.uint8)
        for i, b in enumerate(members):
            pad_into(padded, i, images[b])
        cut_crops(padded, rois, torch.zeros(rois.shape[0], dtype=torch.bool), sizes)

    ways = {
        "padded batch": lambda: cut(list(range(batch))),
        "buckets by size": lambda: [cut(list(range(p, batch, 2))) for p in (0, 1)],
    }
    for label, call in ways.items():
        call()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        print(
            f"device crops on this CPU, {label:16s}: {statistics.median(times) / batch * 1e3:.1f} ms per image"
        )


def compare_blur(repeats: int) -> None:
    """Our PIL-backed blur vs v2.GaussianBlur with a +-3 sigma kernel, on crops of both reference sizes."""
    torch.manual_seed(0)
    for size in (224, 96):
        image = Image.fromarray(torch.randint(0, 256, (size, size, 3), dtype=torch.uint8).numpy())
        ours, theirs = GaussianBlur((0.1, 2.0)), v2.GaussianBlur(13, sigma=(0.1, 2.0))
        times = {"ours (PIL filter)": [], "v2.GaussianBlur(13)": []}
        for _ in range(repeats):
            for name, blur in (("ours (PIL filter)", ours), ("v2.GaussianBlur(13)", theirs)):
                start = time.perf_counter()
                for _ in range(20):
                    blur(image)
                times[name].append((time.perf_counter() - start) / 20 * 1e3)
        a, b = (statistics.median(t) for t in times.values())
        print(f"blur {size}px: ours {a:.2f} ms, v2.GaussianBlur {b:.2f} ms, speed-up x{b / a:.1f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--datasets",
        nargs="+",
        default=["flowers5", "ukbench", "holidays"],
        choices=["flowers5", "ukbench", "holidays", "synthetic", "ci"],
    )
    parser.add_argument("--workers", nargs="+", type=int, default=[0])
    parser.add_argument("--global-size", type=int, default=224)
    parser.add_argument("--local-size", type=int, default=96)
    parser.add_argument("--local-numbers", nargs="+", type=int, default=[8, 10])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-images", type=int, default=96, help="timed images per repeat (after warm-up)")
    parser.add_argument("--photo-files", type=int, default=300, help="files of the repeated photo folders")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare-augment", action="store_true", help="time the device half on this CPU")
    parser.add_argument("--compare-decoders", action="store_true", help="time JPEG decoders on the photos")
    parser.add_argument("--compare-padding", action="store_true", help="time padded vs bucketed crops")
    parser.add_argument("--compare-blur", action="store_true", help="also time the blur implementations")
    parser.add_argument("--ci", action="store_true", help="seconds-long smoke run on small generated JPEGs")
    args = parser.parse_args(argv)
    if args.ci:
        args.datasets, args.workers, args.local_numbers = ["ci"], [0], [2]
        args.global_size, args.local_size = 64, 32
        args.batch_size, args.num_images, args.repeats = 8, 16, 1
    return args


def main(argv: list[str] | None = None) -> list[tuple]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"DINO multi-crop loading, batch {args.batch_size}, {args.num_images} timed images x {args.repeats} "
        f"repeats; {os.cpu_count()} CPUs, load average {load:.1f}"
    )
    workdir = Path(tempfile.mkdtemp(prefix="bench_dataloading_"))
    rows = []
    try:
        for name in args.datasets:
            root = dataset_root(name, workdir, args.photo_files)
            if root is None:
                print(f"{name}: not found under {SHARED}, skipped")
                continue
            count = len(build_dataset(root))
            size = Image.open(build_dataset(root).samples[0][0]).size
            print(f"{name}: {count} files, first {size[0]}x{size[1]}")
            rows += compare_paths(args, name, root)
        if args.compare_augment:
            device_half_rate(args)
        if args.compare_decoders:
            compare_decoders(args, workdir)
        if args.compare_padding:
            compare_padding(args)
        if args.compare_blur:
            compare_blur(args.repeats)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("summary (images/s per worker, and x the CPU path): setting | " + " | ".join(PATHS))
    for label, base, *others in rows:
        cells = " | ".join(f"{r:7.1f} x{r / base:5.2f}" for r in others)
        print(f"  {label:40s} | {base:7.1f} | {cells}")
    return rows


if __name__ == "__main__":
    main()
