"""Where should iBOT's block masks be drawn? Their cost per batch, side by side with a worker's crop work.

    python benchmarks/bench_masking.py                      # batch 64, 2 global crops each, flowers5 photos
    python benchmarks/bench_masking.py --batch 8 --repeats 3  # seconds (the test's size)

Prints, as medians over ``--repeats`` runs, the milliseconds to draw the masks of one batch (``2 x batch`` global
crops, half of them masked, DINOv2's statistics) at the token grids of 224-px crops with 16-px and 8-px patches,
and the milliseconds a DataLoader worker spends on the same batch's CPU crop half (decode, 2 x 224 + 8 x 96
random resized crops and flips, ``ssl_xcit.data.crops``). The ratio is what masks would add to the workers if
they were drawn there; drawn in the training process instead, they cost the printed milliseconds per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("SSL_XCIT_SHARED_DATA", REPO.parent / "shared" / "data"))

from ssl_xcit.data.crops import MultiCropGeometry  # noqa: E402
from ssl_xcit.data.datasets import build_dataset  # noqa: E402
from ssl_xcit.data.synthetic import ensure_synthetic_dataset  # noqa: E402
from ssl_xcit.dino.masking import BlockMaskGenerator, draw_masks  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="images per step and device (2 global crops each)")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)

    rng = np.random.default_rng(0)
    results: dict[str, float] = {}
    for patch in (16, 8):
        grid = (224 // patch, 224 // patch)
        generator = BlockMaskGenerator(grid)
        results[f"masks p{patch}"] = median_ms(
            lambda g=generator, s=grid: draw_masks(2 * args.batch, s, rng, generator=g), args.repeats
        )
    root = SHARED / "flowers5" if (SHARED / "flowers5").is_dir() else ensure_synthetic_dataset() / "train"
    paths = [path for path, _ in build_dataset(str(root)).samples[: args.batch]]
    geometry = MultiCropGeometry(global_crops_scale=(0.32, 1.0), local_crops_scale=(0.05, 0.32))
    results["crops"] = median_ms(lambda: [geometry(geometry.read(path)) for path in paths], args.repeats)

    print(
        f"batch {args.batch} images ({2 * args.batch} global crops), median of {args.repeats}, photos: {root.name}"
    )
    print(f"{'work per batch':52s} {'ms':>8s} {'x crops':>8s}")
    print(f"{'worker CPU crop half (decode + 2x224 + 8x96 crops)':52s} {results['crops']:8.2f} {1.0:8.3f}")
    for patch in (16, 8):
        ms = results[f"masks p{patch}"]
        label = f"block masks, {224 // patch}x{224 // patch} grid (224 px, patch {patch})"
        print(f"{label:52s} {ms:8.2f} {ms / results['crops']:8.3f}")
    return results


if __name__ == "__main__":
    main()
