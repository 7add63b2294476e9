"""``ssl-xcit segment``: linear semantic segmentation probe on frozen patch tokens (DINOv2's linear protocol).

ssl-xcit segment --weights teacher.pth --train camvid/train --val camvid/val --ignore-index 11 --output seg.json
ssl-xcit segment --arch xcit_nano_12_p8 --train VOC2012 --val VOC2012      # random-init baseline, VOC layout
ssl-xcit segment --weights teacher.pth --train ADE/train --val ADE/val --reduce-zero-label   # ADE20K's ids
ssl-xcit segment --fast --weights teacher.pth --train camvid/train --val camvid/val --ignore-index 11
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from ssl_xcit.cli.knn import add_backbone_arguments


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ssl-xcit segment",
        description="Linear segmentation probe (DINOv2): BatchNorm + 1x1 linear layer on the frozen final-norm "
        "patch tokens, trained for --iters iterations on augmented crops (resize 0.5-2x, crop, flip, "
        "photometric distortion), scored with sliding windows; --fast trains on cached tokens of whole images "
        "instead. mIoU, per-class IoU and pixel accuracy on val from one confusion matrix over all its pixels.",
    )
    add_backbone_arguments(parser)
    layout = "DIR/images/ + DIR/masks/ (NAME.png of class ids per image), or a VOC folder (JPEGImages/, " \
        "SegmentationClass/, ImageSets/Segmentation/{train,val}.txt)"  # fmt: skip
    parser.add_argument(
        "--train", required=True, help=f"train images and masks: {layout}; VOC reads train.txt"
    )
    parser.add_argument(
        "--val", required=True, help="val images and masks, the same layouts; VOC reads val.txt"
    )
    parser.add_argument(
        "--ignore-index",
        type=int,
        default=255,
        help="mask value of unlabelled pixels, neither trained on nor scored (VOC, mmsegmentation: 255)",
    )
    parser.add_argument(
        "--reduce-zero-label",
        action="store_true",
        help="id 0 is unlabelled and every other id drops by one (ADE20K's masks, as mmsegmentation reads them)",
    )
    parser.add_argument(
        "--num-classes",
        type=int,
        default=None,
        help="class ids are 0..N-1 (default: 1 + the largest id in the train and val masks, the ignore value "
        "aside)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        choices=(1, 4),
        default=1,
        help="final-norm patch tokens of the last block (1) or of the last 4 blocks concatenated (4, DINOv2's "
        "multi-layer linear head)",
    )
    parser.add_argument(
        "--fast",
        action="store_true",
        help="the quick screen: the head on cached tokens of whole images, no augmentation, --epochs passes "
        "(not DINOv2's protocol: docs/evaluation.md)",
    )
    parser.add_argument(
        "--iters",
        type=int,
        default=40_000,
        help="training iterations of the default protocol (DINOv2: 40000)",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="--fast only: passes over the cached train tokens (default 40)",
    )
    parser.add_argument(
        "--short-side",
        type=int,
        default=None,
        help="images are scaled so their short side is this (the long side at most 4x it), jittered 0.5-2x in "
        "training (default 512, DINOv2's; --fast: each image's own size, rounded to the patch multiple). "
        "Scores are always at the mask's full size",
    )
    parser.add_argument(
        "--crop-size", type=int, default=512, help="training crop and sliding window side (512)"
    )
    parser.add_argument("--stride", type=int, default=341, help="sliding window stride (DINOv2: 341)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (DINOv2: 1e-3)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="crops per iteration (DINOv2: 16); --fast: images per batch, for extraction and the head",
    )
    parser.add_argument(
        "--num-workers", type=int, default=8, help="image-decoding (and augmenting) processes"
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="feature cache folder (default $SSL_XCIT_CACHE/features or ~/.cache/ssl_xcit/features), shared with "
        "knn and keyed the same way",
    )
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the feature cache")
    parser.add_argument(
        "--accelerator", default="auto", help="Lightning accelerator (cpu, gpu, auto); one device"
    )
    parser.add_argument(
        "--precision",
        default=None,
        help="Lightning precision of the extraction, e.g. bf16-mixed (default fp32)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of a random-init backbone and of the head")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.add_argument("--output", default=None, help="write the results as JSON here (atomic)")
    parser.add_argument(
        "--predictions",
        default=None,
        help="folder for one PNG of predicted class ids per val image, NAME.png at its mask's size",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the segmentation probe; returns the results dict (also written to --output)."""
    from ssl_xcit.cli.quiet import cap_workers
    from ssl_xcit.evaluation.segmentation import run_segment

    args = build_parser().parse_args(argv)
    return run_segment(
        args.train,
        args.val,
        weights=args.weights,
        arch=args.arch,
        layers=args.layers,
        fast=args.fast,
        iters=args.iters,
        epochs=args.epochs,
        short_side=args.short_side,
        crop_size=args.crop_size,
        stride=args.stride,
        reduce_zero_label=args.reduce_zero_label,
        ignore_index=args.ignore_index,
        num_classes=args.num_classes,
        lr=args.lr,
        batch_size=args.batch_size,
        num_workers=cap_workers(args.num_workers, "--num-workers"),
        cache_dir=args.cache_dir,
        use_cache=not args.no_cache,
        accelerator=args.accelerator,
        precision=args.precision,
        seed=args.seed,
        progress=not args.no_progress,
        output=args.output,
        predictions=args.predictions,
    )


if __name__ == "__main__":
    main()
