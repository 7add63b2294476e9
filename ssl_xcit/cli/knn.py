"""``ssl-xcit knn``: weighted k-NN accuracy of a frozen backbone (DINO's ``eval_knn.py`` protocol).

ssl-xcit knn --weights teacher.pth --train imagenet/train --val imagenet/val --output knn.json
ssl-xcit knn --arch xcit_nano_12_p16 --train D/train --val D/val     # random-init baseline
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from ssl_xcit.evaluation.knn import BACKENDS, DEFAULT_KS, DEFAULT_TEMPERATURE


def add_backbone_arguments(parser: argparse.ArgumentParser) -> None:
    """--weights and --arch: the frozen backbone (shared by knn, linear and embed)."""
    parser.add_argument(
        "--weights",
        default=None,
        help="backbone checkpoint: our Lightning .ckpt (teacher preferred), an exported state dict, or an "
        "official XCiT/DINO checkpoint. Omit it and give --arch to evaluate a RANDOMLY INITIALISED backbone, "
        "the baseline every pretrained number should beat.",
    )
    parser.add_argument(
        "--arch",
        default=None,
        help="registered backbone name (e.g. xcit_small_12_p16); inferred from the checkpoint when omitted, and "
        "checked against it when given (a checkpoint of another architecture is an error)",
    )


def add_extraction_arguments(parser: argparse.ArgumentParser) -> None:
    """Batching, the eval transform, the feature cache and the devices (shared by knn, linear and embed)."""
    parser.add_argument("--batch-size", type=int, default=128, help="images per device per batch (DINO: 128)")
    parser.add_argument("--num-workers", type=int, default=8, help="data-loading processes per device")
    parser.add_argument(
        "--resize-size",
        type=int,
        default=256,
        help="short side before the centre crop (DINO: 256 = 224 / 0.875)",
    )
    parser.add_argument(
        "--crop-size",
        type=int,
        default=224,
        help="centre crop (DINO: 224); must be a multiple of the patch size",
    )
    parser.add_argument(
        "--n-last-blocks",
        type=int,
        default=1,
        help="concatenate the CLS embeddings of the last n blocks (1 = final CLS, DINO's XCiT feature)",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="feature cache folder (default $SSL_XCIT_CACHE/features or ~/.cache/ssl_xcit/features); entries are "
        "keyed on the checkpoint sha256, model, transform and file list, so they are never served stale",
    )
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the feature cache")
    parser.add_argument(
        "--accelerator", default="auto", help="Lightning accelerator for extraction (cpu, gpu, auto)"
    )
    parser.add_argument(
        "--devices", default="auto", help="Lightning devices: a count, a list, or auto (all GPUs)"
    )
    parser.add_argument(
        "--precision", default=None, help="Lightning precision, e.g. bf16-mixed on GPU (default fp32)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of a random-init backbone (and the probe)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def add_feature_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``knn`` and ``linear``: backbone, data, transform, cache, devices."""
    add_backbone_arguments(parser)
    parser.add_argument(
        "--train", required=True, help="labelled train images: an ImageFolder tree (class subfolders)"
    )
    parser.add_argument(
        "--val", required=True, help="labelled val images with the same class subfolders as --train"
    )
    add_extraction_arguments(parser)
    parser.add_argument(
        "--avgpool-patchtokens", action="store_true", help="append the average-pooled final patch tokens"
    )
    parser.add_argument("--output", default=None, help="write the results as JSON here (atomic)")


def parse_devices(value: str) -> int | str | list[int]:
    """--devices as Lightning takes it: "auto", a count, or a comma-separated list of device ids."""
    if value == "auto":
        return value
    if "," in value:
        return [int(v) for v in value.split(",") if v]
    return int(value) if value.lstrip("-").isdigit() else value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ssl-xcit knn",
        description="Weighted k-NN top-1/top-5 of frozen features, following DINO: cosine similarity of "
        "L2-normalised features, votes exp(sim / T) from the k nearest train images, all k from one search.",
    )
    add_feature_arguments(parser)
    parser.add_argument(
        "--k",
        type=int,
        nargs="+",
        default=list(DEFAULT_KS),
        help="numbers of neighbours, all reported together (DINO: 10 20 100 200; 20 usually works best). A k "
        "larger than the train set is clamped to it with a warning",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=DEFAULT_TEMPERATURE,
        help="vote temperature T in exp(sim / T) (DINO: 0.07; lower = closest neighbours dominate)",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="torch",
        help="neighbour search: chunked torch matmul+topk (CPU or GPU) or faiss exact inner product "
        "(IndexFlatIP, faiss GPU when available); same accuracies",
    )
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="queries per similarity chunk (default: sized so one chunk's similarity matrix is <= 256 MiB)",
    )
    parser.add_argument(
        "--knn-device", default="auto", help="device of the torch search (auto: cuda when available)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the k-NN evaluation; returns the results dict (also written to --output)."""
    from ssl_xcit.cli.quiet import cap_workers
    from ssl_xcit.evaluation.pipeline import evaluate_knn

    args = build_parser().parse_args(argv)
    return evaluate_knn(
        args.train,
        args.val,
        weights=args.weights,
        arch=args.arch,
        ks=args.k,
        temperature=args.temperature,
        backend=args.backend,
        batch_size=args.batch_size,
        num_workers=cap_workers(args.num_workers, "--num-workers"),
        resize_size=args.resize_size,
        crop_size=args.crop_size,
        n_last_blocks=args.n_last_blocks,
        avgpool_patchtokens=args.avgpool_patchtokens,
        cache_dir=args.cache_dir,
        use_cache=not args.no_cache,
        accelerator=args.accelerator,
        devices=parse_devices(args.devices),
        precision=args.precision,
        knn_device=args.knn_device,
        chunk_size=args.chunk_size,
        output=args.output,
        seed=args.seed,
        progress=not args.no_progress,
    )


if __name__ == "__main__":
    main()
