"""``ssl-xcit embed``: one embedding row per image (path, label if any, embedding) in a .npz, .csv or .pt file.

ssl-xcit embed --weights teacher.pth --data my_photos/ --output emb.npz
ssl-xcit embed --weights teacher.pth --data D/train --output emb.csv --feature both --normalize
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from ssl_xcit.cli.knn import add_backbone_arguments, add_extraction_arguments, parse_devices


def build_parser() -> argparse.ArgumentParser:
    from ssl_xcit.evaluation.embedding_files import FORMATS
    from ssl_xcit.evaluation.embeddings import FEATURES

    parser = argparse.ArgumentParser(
        prog="ssl-xcit embed",
        description="Frozen features of every readable image, one row per image, by default the feature "
        "`ssl-xcit knn` uses (same transform, extraction and cache). Unreadable images are skipped and listed.",
    )
    add_backbone_arguments(parser)
    parser.add_argument(
        "--data",
        required=True,
        help="images: a folder (searched recursively), an ImageFolder tree (rows get its class labels) or a "
        "text file listing one image per line (optionally with a label)",
    )
    parser.add_argument(
        "--output",
        required=True,
        help=f"file to write, format from the extension ({', '.join(FORMATS)}); a .csv also gets OUT.json "
        "with the metadata and skipped files. Written to a temporary file and renamed: never half-written",
    )
    parser.add_argument(
        "--feature",
        choices=FEATURES,
        default="cls",
        help="cls: the CLS embedding, as knn uses it (with --n-last-blocks N the last N concatenated); patch: "
        "the average-pooled patch tokens; both: one array, CLS columns first, then the pooled patch tokens "
        "(knn's --avgpool-patchtokens feature)",
    )
    parser.add_argument("--normalize", action="store_true", help="L2-normalise every row (cosine-ready)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing --output (default: refuse and stop)"
    )
    add_extraction_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Embed the images; prints one summary line and returns the summary."""
    from ssl_xcit.cli.quiet import cap_workers
    from ssl_xcit.evaluation.embeddings import embed_images

    args = build_parser().parse_args(argv)
    return embed_images(
        args.data,
        args.output,
        weights=args.weights,
        arch=args.arch,
        feature=args.feature,
        n_last_blocks=args.n_last_blocks,
        normalize=args.normalize,
        overwrite=args.overwrite,
        batch_size=args.batch_size,
        num_workers=cap_workers(args.num_workers, "--num-workers"),
        resize_size=args.resize_size,
        crop_size=args.crop_size,
        cache_dir=args.cache_dir,
        use_cache=not args.no_cache,
        accelerator=args.accelerator,
        devices=parse_devices(args.devices),
        precision=args.precision,
        seed=args.seed,
        progress=not args.no_progress,
    )


if __name__ == "__main__":
    main()
