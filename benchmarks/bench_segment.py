"""The linear segmentation probe on CamVid: random-init XCiT (depth cut) against raw pixels, mIoU and wall time.

    python benchmarks/bench_segment.py --iters 40000                     # DINOv2's protocol, its sizes
    python benchmarks/bench_segment.py --short-side 180 --crop-size 180 --stride 120 --iters 1000 --batch-size 8
    python benchmarks/bench_segment.py --fast --epochs 40                # cached whole-image tokens
    python benchmarks/bench_segment.py --weights dino=runs/dino.pth --weights gram=runs/gram.pth --no-baselines

Every row is ``ssl-xcit segment``'s probe of final-norm patch tokens of stride 8 (DINOv2's protocol unless
``--fast``; sizes, budget and lr as given): raw pixels (each 8 x 8 patch flattened, 192 dims, ``PixelPatches``)
and XCiT-N12/8 at random initialisation (seed 0) with its first ``--depth`` blocks. ``--weights NAME=PATH`` adds
a row per trained backbone (any file ``ssl-xcit segment --weights`` takes), probed the same way;
``--no-baselines`` leaves out the two rows above (curves over many checkpoints). Void (id 11) is ignored.
``--limit`` keeps the first N images of each split, for a quick look; ``--json`` appends one line per row.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _subset(camvid: Path, root: Path, limit: int | None) -> tuple[Path, Path]:
    for split in ("train", "val"):
        for sub in ("images", "masks"):
            (root / split / sub).mkdir(parents=True)
        for image in sorted((camvid / split / "images").glob("*.jpg"))[:limit]:
            os.symlink(image.resolve(), root / split / "images" / image.name)
            mask = camvid / split / "masks" / f"{image.stem}.png"
            os.symlink(mask.resolve(), root / split / "masks" / mask.name)
    return root / "train", root / "val"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--camvid", type=Path, default=REPO.parent / "shared" / "data" / "camvid")
    parser.add_argument("--fast", action="store_true", help="the head on cached whole-image tokens")
    parser.add_argument("--epochs", type=int, default=None, help="--fast: passes (default 40)")
    parser.add_argument("--iters", type=int, default=40_000, help="iterations of DINOv2's protocol")
    parser.add_argument("--crop-size", type=int, default=512)
    parser.add_argument("--stride", type=int, default=341)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=1, choices=(1, 4))
    parser.add_argument("--seed", type=int, default=0, help="the head's seed (and its crops')")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--depth", type=int, default=4, help="XCiT-N12/8 blocks kept")
    parser.add_argument("--short-side", type=int, default=None)
    parser.add_argument("--limit", type=int, default=None, help="first N images per split")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument(
        "--weights", action="append", default=[], metavar="NAME=PATH", help="a trained backbone"
    )
    parser.add_argument("--no-baselines", action="store_true", help="skip the random-init and raw-pixel rows")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--json", type=Path, default=None, help="append one JSON line per row to this file")
    args = parser.parse_args(argv)
    weights = [item.split("=", 1) for item in args.weights]
    if any(len(pair) != 2 for pair in weights):
        parser.error(f"--weights takes NAME=PATH, got {args.weights}")

    import torch

    from ssl_xcit.evaluation.segmentation import run_segment
    from ssl_xcit.evaluation.segmentation.pixels import PixelPatches
    from ssl_xcit.models import create_model

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models: list[tuple[str, dict]] = [(name, {"weights": path}) for name, path in weights]
    if not args.no_baselines:
        xcit = create_model("xcit_nano_12_p8", depth=args.depth)
        models += [
            (f"XCiT-N12/8, {args.depth} blocks, random init", {"model": xcit}),
            ("raw pixels", {"model": PixelPatches(8)}),
        ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        train, val = _subset(args.camvid, Path(tmp) / "data", args.limit)
        for name, source in models:
            start = time.perf_counter()
            r = run_segment(train, val, **source, ignore_index=11, num_classes=11, fast=args.fast,
                            epochs=args.epochs, iters=args.iters, crop_size=args.crop_size, stride=args.stride,
                            batch_size=args.batch_size, layers=args.layers, seed=args.seed, lr=args.lr,
                            short_side=args.short_side, num_workers=2, accelerator=args.accelerator,
                            cache_dir=Path(tmp) / "cache", progress=False)  # fmt: skip
            rows.append((name, r, time.perf_counter() - start))
    budget = (
        f"fast, {rows[0][1]['epochs']} epochs"
        if args.fast
        else f"{args.iters} iterations of {args.batch_size}"
    )
    print(f"\nCamVid {rows[0][1]['num_train']} train / {rows[0][1]['num_val']} val, {budget}, lr {args.lr}")
    print("| features | dim | mIoU | pixel acc | wall s |\n|---|---|---|---|---|")
    for name, r, wall in rows:
        print(f"| {name} | {r['feature_dim']} | {r['miou']:.2f} | {r['pixel_acc']:.2f} | {wall:.0f} |")
    results = [
        {"name": name, "miou": r["miou"], "pixel_acc": r["pixel_acc"], "per_class_iou": r["per_class_iou"],
         "feature_dim": r["feature_dim"], "wall_s": wall, "fast": args.fast, "epochs": r["epochs"],
         "iters": r["iters"], "crop_size": r["crop_size"], "stride": r["stride"], "batch_size": args.batch_size,
         "layers": args.layers, "seed": args.seed, "lr": args.lr, "short_side": args.short_side,
         "limit": args.limit}
        for name, r, wall in rows
    ]  # fmt: skip
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in results)
    return results


if __name__ == "__main__":
    main()
