"""A copy of an image folder with every image's shorter side resized to S px (bicubic), same tree and names.

    python benchmarks/resize_folder.py ../shared/data/flowers5 flowers5_96 --short-side 96

Only to save decoding time in measurements whose crops are all at most S px: each image is decoded once here
instead of at every epoch. An image already at most S px on its shorter side is copied as it is; JPEGs stay
JPEGs (quality 95). An existing DST is refused rather than mixed with.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from PIL import Image

from ssl_xcit.data.folders import is_image_file


def resize_folder(src: Path, dst: Path, short_side: int) -> int:
    """Write the resized copy of ``src`` into ``dst``; returns the number of images."""
    if dst.exists():
        raise SystemExit(f"resize_folder: {dst} exists; give a new folder")
    count = 0
    for path in sorted(p for p in src.rglob("*") if p.is_file() and is_image_file(p)):
        out = dst / path.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        with Image.open(path) as image:
            w, h = image.size
            if min(w, h) <= short_side:
                shutil.copyfile(path, out)
            else:
                scale = short_side / min(w, h)
                size = (max(short_side, round(w * scale)), max(short_side, round(h * scale)))
                image.convert("RGB").resize(size, Image.BICUBIC).save(out, quality=95)
        count += 1
    return count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--short-side", type=int, required=True)
    args = p.parse_args(argv)
    count = resize_folder(args.src, args.dst, args.short_side)
    print(f"{count} images -> {args.dst} (shorter side {args.short_side} px)")
    return count


if __name__ == "__main__":
    main()
