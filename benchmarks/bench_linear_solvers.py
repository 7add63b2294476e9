"""Linear probe solvers side by side: ``--solver lbfgs`` (CLIP), ``--fast`` (SGD on cached features) and the
full SGD probe (augmented images through the frozen backbone), top-1 and wall time in one run.

    python benchmarks/bench_linear_solvers.py --data flowers5 --full-epochs 5
    python benchmarks/bench_linear_solvers.py --data cifar10 --full-epochs 5

All three probe the same backbone: ``--arch`` at random initialisation from ``--seed`` (identical weights in
every run), or ``--weights``. The features of the cached modes are extracted once, first, and that time is
reported on its own row; ``--fast`` and ``lbfgs`` then read them from the cache, as a user's second command does.
flowers5 is split 80/20 with ``stratified_split`` (seed 0), as ``benchmarks/learning.py --data flowers5``;
cifar10 is cifar10_12k's train/test.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _flowers_split(shared: Path, root: Path) -> tuple[Path, Path]:
    from ssl_xcit.data.datasets import build_dataset
    from ssl_xcit.data.splits import stratified_split

    full = build_dataset(shared / "flowers5")
    for name, part in zip(("train", "val"), stratified_split(full.samples, 0.2, seed=0), strict=True):
        for path, label in part:
            target = root / name / full.classes[label] / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(path.resolve(), target)
    return root / "train", root / "val"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", choices=("flowers5", "cifar10"), required=True)
    parser.add_argument("--shared", default=str(REPO.parent / "shared" / "data"))
    parser.add_argument("--arch", default="xcit_nano_12_p16")
    parser.add_argument("--weights", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resize-size", type=int, default=73)
    parser.add_argument("--crop-size", type=int, default=64)
    parser.add_argument("--full-epochs", type=int, default=5, help="epochs of the full SGD probe (DINO: 100)")
    parser.add_argument("--num-workers", type=int, default=1)
    args = parser.parse_args()

    from ssl_xcit.evaluation.linear import DEFAULT_SWEEP_LRS, run_linear

    shared = Path(args.shared)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        if args.data == "flowers5":
            train, val = _flowers_split(shared, scratch / "split")
        else:
            train, val = shared / "cifar10_12k" / "train", shared / "cifar10_12k" / "test"
        common = dict(
            weights=args.weights, arch=None if args.weights else args.arch, seed=args.seed,
            resize_size=args.resize_size, crop_size=args.crop_size, batch_size=128,
            num_workers=args.num_workers, cache_dir=str(scratch / "cache"), accelerator="cpu", devices=1,
            progress=False, default_root_dir=str(scratch / "lightning"),
        )  # fmt: skip
        rows = []

        def timed(label: str, **kwargs) -> dict:
            start = time.perf_counter()
            results = run_linear(str(train), str(val), **common, **kwargs)
            rows.append((label, results["best"]["top1"], time.perf_counter() - start))
            return results

        from ssl_xcit.evaluation.cached import split_features
        from ssl_xcit.evaluation.features import FeatureConfig
        from ssl_xcit.evaluation.linear.data import _eval_transform
        from ssl_xcit.evaluation.pipeline import load_split_datasets

        start = time.perf_counter()
        train_ds, val_ds = load_split_datasets(train, val, _eval_transform(args.resize_size, args.crop_size))
        split_features(
            train_ds, val_ds, weights=args.weights, arch=common["arch"], config=FeatureConfig(), seed=args.seed,
            cache_dir=scratch / "cache", batch_size=128, num_workers=args.num_workers, accelerator="cpu",
            devices=1, progress=False,
        )  # fmt: skip
        extraction = time.perf_counter() - start
        lbfgs = timed("--solver lbfgs", solver="lbfgs")
        timed("--fast (13 lrs, 100 epochs)", fast=True)
        timed(
            f"full SGD (13 lrs, {args.full_epochs} epochs)",
            lrs=list(DEFAULT_SWEEP_LRS),
            epochs=args.full_epochs,
        )
    who = args.weights or f"{args.arch} random init (seed {args.seed})"
    print(f"\n{args.data}: {len(train_ds)} train / {len(val_ds)} val, {who}, {args.crop_size} px")
    print(f"feature extraction (train + val, once, shared by lbfgs and --fast): {extraction:.1f} s")
    print(f"lbfgs best C {lbfgs['best']['C']:.3g}")
    print("| probe | top-1 % | wall s |\n|---|---|---|")
    for label, top1, seconds in rows:
        print(f"| {label} | {top1:.2f} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
