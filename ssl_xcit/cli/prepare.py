"""``ssl-xcit prepare SRC OUT``: write an image folder, ImageFolder tree or list file as LitData shards.

ssl-xcit prepare photos/ photos_shards/ --workers 8
ssl-xcit prepare train.txt s3://bucket/train --resize-short 512
ssl-xcit prepare photos/ photos_shards/ --workers 8 --resume   # after an interruption

``knn``, ``linear`` and ``embed`` take OUT wherever they take an image folder.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ssl-xcit prepare",
        description="Write every readable image of SRC, as its original file bytes, its label and its path, "
        "into LitData chunks in OUT, in the order the other commands list SRC. Unreadable files are skipped and "
        "named. OUT is written beside itself and renamed into place once finished (a URL is written in place, "
        "its ssl_xcit_shards.json last).",
    )
    parser.add_argument("src", help="an ImageFolder tree, a folder of images (recursive) or a .txt list file")
    parser.add_argument("out", help="folder to create, or an s3:// or gs:// URL")
    parser.add_argument("--workers", type=int, default=1, help="processes encoding in parallel (default 1)")
    parser.add_argument(
        "--resize-short",
        type=int,
        default=None,
        metavar="S",
        help="store images whose shorter side exceeds S px resized to S (JPEG stays JPEG at quality 95, other "
        "formats become PNG); default: the original bytes",
    )
    parser.add_argument("--chunk-bytes", default="64MB", help="size of each chunk file (default 64MB)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an OUT that holds a prepared dataset, finished or interrupted (only once the new one is "
        "complete); default: refuse",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted prepare of OUT with the same SRC and settings, after the chunks it stored; "
        "a finished OUT is left as it is, and with nothing to continue it starts afresh",
    )
    parser.add_argument(
        "--storage-options",
        default=None,
        metavar="JSON",
        help='for an s3:// OUT: boto3 client settings as a JSON object, e.g. \'{"endpoint_url": '
        '"http://minio:9000"}\' (default: AWS_ENDPOINT_URL, AWS_PROFILE and the like; docs/cluster.md)',
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (the summary is still printed)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Prepare the shards; prints a summary (skipped files named) and returns it."""
    from ssl_xcit.cli.quiet import cap_workers
    from ssl_xcit.data.shards import prepare_shards
    from ssl_xcit.data.storage import storage_options

    args = build_parser().parse_args(argv)
    return prepare_shards(
        args.src,
        args.out,
        workers=cap_workers(args.workers, "--workers"),
        resize_short=args.resize_short,
        chunk_bytes=args.chunk_bytes,
        overwrite=args.overwrite,
        resume=args.resume,
        storage_options=storage_options(args.storage_options),
        progress=not args.no_progress,
    )


if __name__ == "__main__":
    main()
