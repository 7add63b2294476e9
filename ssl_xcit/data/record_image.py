"""A shard record's image bytes: decoded as the readers decode files, or re-encoded smaller by ``prepare``."""

from __future__ import annotations

import io

from PIL import Image, ImageOps


def decode_image(data: bytes, exif_transpose: bool = True) -> Image.Image:
    """Decode a record's encoded bytes into an RGB PIL image (EXIF orientation applied, as for files)."""
    with Image.open(io.BytesIO(data)) as image:
        image.load()  # the full decode, so truncated bytes raise here
        if exif_transpose:
            image = ImageOps.exif_transpose(image)
        return image.convert("RGB")


def resize_short_side(data: bytes, short: int) -> bytes:
    """``data`` re-encoded with its shorter side ``short`` px, or unchanged when that side is not longer.

    The EXIF orientation is applied first (the re-encoded file carries none). JPEG stays JPEG (quality 95),
    every other format becomes PNG (lossless), so that nothing but the resize loses detail.
    """
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        fmt = image.format
        icc = image.info.get("icc_profile")
        image = ImageOps.exif_transpose(image)
        width, height = image.size
        if min(width, height) <= short:
            return data
        scale = short / min(width, height)
        size = (short, round(height * scale)) if width <= height else (round(width * scale), short)
        if image.mode not in ("RGB", "RGBA", "L", "LA"):
            image = image.convert("RGBA" if "transparency" in image.info or "A" in image.mode else "RGB")
        image = image.resize(size, Image.Resampling.LANCZOS)
        out = io.BytesIO()
        if fmt == "JPEG":
            image.convert("RGB" if image.mode != "L" else "L").save(out, "JPEG", quality=95, icc_profile=icc)
        else:
            image.save(out, "PNG", icc_profile=icc)
        return out.getvalue()
