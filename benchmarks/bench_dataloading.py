"""Data-loading throughput of the DINO multi-crop pipeline: images/s in total and per DataLoader worker.

Each image is decoded once and turned into 2 global + N local crops (default 2x224 + 8x96, the reference), so
this is the rate at which the data side can feed a training step; compare it with the training-step images/s
of the DINO throughput benchmark to know which one limits a run (workers needed = step rate / per-worker rate).

Run from the repository root (flowers5 is read from ../shared/data; the synthetic set is generated on first use):

    python benchmarks/bench_dataloading.py
    python benchmarks/bench_dataloading.py --workers 0 1 2 --num-images 160 --repeats 3 --compare-blur
    python benchmarks/bench_dataloading.py --global-size 64 --local-size 32 --datasets synthetic

num_workers=0 decodes in the main process (counted as one worker). Timing starts after the first batch, so
worker start-up is excluded; each configuration is repeated and the median is printed. Torch intra-op threads
are set to 1 in the main process, as DataLoader does in its workers, so the per-worker rates are comparable.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from ssl_xcit.data.datasets import ImageDataset, build_dataset, collate_skip_none, load_image
from ssl_xcit.data.synthetic import ensure_synthetic_dataset
from ssl_xcit.data.transforms import GaussianBlur, MultiCropTransform

REPO_ROOT = Path(__file__).resolve().parents[1]


def dataset_root(name: str) -> Path | None:
    if name == "flowers5":
        shared = Path(os.environ.get("SSL_XCIT_SHARED_DATA") or REPO_ROOT.parent / "shared" / "data")
        path = shared / "flowers5"
        return path if path.is_dir() else None
    return ensure_synthetic_dataset() / "train"


def loader_rate(dataset: ImageDataset, workers: int, batch_size: int, num_images: int, seed: int) -> float:
    """Images/s after the first batch, until ``num_images`` more have been delivered."""
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=generator,
        num_workers=workers,
        collate_fn=collate_skip_none,
        drop_last=True,
    )
    iterator = iter(loader)
    next(iterator)  # worker start-up and the first decode are not counted
    start, seen = time.perf_counter(), 0
    while seen < num_images:
        crops, _, _ = next(iterator)
        seen += crops[0].shape[0]
    rate = seen / (time.perf_counter() - start)
    del iterator
    return rate


def decode_rate(dataset: ImageDataset, num_images: int) -> float:
    paths = [p for p, _ in dataset.samples[:num_images]]
    start = time.perf_counter()
    for path in paths:
        load_image(path)
    return len(paths) / (time.perf_counter() - start)


def compare_blur(repeats: int) -> None:
    """Our PIL-backed blur vs v2.GaussianBlur with a +-3 sigma kernel, on crops of both reference sizes."""
    from PIL import Image

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--datasets", nargs="+", default=["flowers5", "synthetic"], choices=["flowers5", "synthetic"]
    )
    parser.add_argument("--workers", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--global-size", type=int, default=224)
    parser.add_argument("--local-size", type=int, default=96)
    parser.add_argument("--local-number", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-images", type=int, default=160, help="timed images per repeat (after warm-up)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare-blur", action="store_true", help="also time the blur implementations")
    args = parser.parse_args()

    torch.set_num_threads(1)
    transform = MultiCropTransform(
        global_crops_size=args.global_size,
        local_crops_size=args.local_size,
        local_crops_number=args.local_number,
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"multi-crop 2x{args.global_size} + {args.local_number}x{args.local_size}, batch {args.batch_size}, "
        f"{args.num_images} timed images x {args.repeats} repeats; {os.cpu_count()} CPUs, load average {load:.1f}"
    )
    for name in args.datasets:
        root = dataset_root(name)
        if root is None:
            print(f"{name}: not found (expected ../shared/data/flowers5), skipped")
            continue
        dataset = build_dataset(root, transform=transform)
        decode = statistics.median(decode_rate(dataset, 200) for _ in range(args.repeats))
        print(f"{name}: {len(dataset)} images at {root.name}/; decode only: {decode:.0f} images/s")
        for workers in args.workers:
            rates = [
                loader_rate(dataset, workers, args.batch_size, args.num_images, seed=r)
                for r in range(args.repeats)
            ]
            rate = statistics.median(rates)
            print(
                f"  num_workers={workers}: {rate:7.1f} images/s, {rate / max(workers, 1):6.1f} images/s per worker "
                f"({rate * transform.num_crops:.0f} crops/s; runs: {', '.join(f'{r:.1f}' for r in rates)})"
            )
    if args.compare_blur:
        compare_blur(args.repeats)


if __name__ == "__main__":
    main()
