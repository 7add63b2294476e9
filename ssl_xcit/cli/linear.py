"""``ssl-xcit linear``: linear probe on a frozen backbone (DINO's ``eval_linear.py`` protocol).

    ssl-xcit linear --weights teacher.pth --train imagenet/train --val imagenet/val --epochs 100
    ssl-xcit linear --weights teacher.pth --train D/train --val D/val --fast      # cached features, lr sweep
    ssl-xcit linear --weights teacher.pth --train D/train --val D/val --solver lbfgs   # CLIP's protocol

The same probe through LightningCLI (configurable trainer, checkpoints, loggers):

    ssl-xcit fit -c eval/linear_xcit.yaml --model.weights W --data.train D/train --data.val D/val
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence
from typing import Any

from ssl_xcit.cli.knn import add_feature_arguments, parse_devices


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ssl-xcit linear",
        description="Linear probe on frozen features, following DINO: SGD momentum 0.9, lr x total batch / 256, "
        "cosine schedule, no weight decay, RandomResizedCrop + flip for training, eval transform for val.",
    )
    add_feature_arguments(parser)
    parser.add_argument(
        "--fast",
        action="store_true",
        help="train on cached eval-transform features (no augmentation, shares the k-NN cache) and sweep --lrs "
        "with one head per lr in one pass; minutes instead of hours, usually within a point of the full probe",
    )
    parser.add_argument(
        "--solver",
        choices=("sgd", "lbfgs"),
        default="sgd",
        help="sgd: DINO's probe (with --fast on cached features); lbfgs: scikit-learn's L-BFGS logistic regression "
        "on the cached features with C swept on a held-out 20%% of train, then refit on all of it (CLIP's "
        "linear-probe protocol; --lrs and --epochs do not apply)",
    )
    parser.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=None,
        help="base learning rate(s) for a total batch of 256; several train one head each on the same batches "
        "and the best is reported (default: 0.001 as DINO; with --fast DINOv2's 13-value sweep 1e-5..0.1)",
    )
    parser.add_argument("--epochs", type=int, default=100, help="training epochs (DINO: 100)")
    parser.add_argument("--default-root-dir", default=None, help="Lightning folder for checkpoints")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train and validate the probe; prints a table, returns (and writes to --output) the results."""
    from ssl_xcit.cli.quiet import cap_workers
    from ssl_xcit.evaluation.linear import run_linear
    from ssl_xcit.evaluation.report import format_linear_table

    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():
        # The probe's backbone is frozen in eval mode on purpose; Lightning's notice would say otherwise.
        warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
        results = run_linear(
            args.train,
            args.val,
            weights=args.weights,
            arch=args.arch,
            fast=args.fast,
            solver=args.solver,
            lrs=args.lrs,
            epochs=args.epochs,
            batch_size=args.batch_size,
            num_workers=cap_workers(args.num_workers, "--num-workers"),
            n_last_blocks=args.n_last_blocks,
            avgpool_patchtokens=args.avgpool_patchtokens,
            crop_size=args.crop_size,
            resize_size=args.resize_size,
            cache_dir=args.cache_dir,
            use_cache=not args.no_cache,
            output=args.output,
            default_root_dir=args.default_root_dir,
            accelerator=args.accelerator,
            devices=parse_devices(args.devices),
            precision=args.precision,
            seed=args.seed,
            progress=not args.no_progress,
        )
    from lightning.pytorch.utilities import rank_zero_only

    if getattr(rank_zero_only, "rank", 0) == 0:
        print(format_linear_table(results))
    return results


if __name__ == "__main__":
    main()
