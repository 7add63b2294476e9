"""LitData shards: the on-disk (or object-storage) format that ``ssl-xcit prepare`` writes and every command reads.

A prepared dataset is a folder (local, or a ``s3://``, ``gs://`` or ``azure://`` URL) holding LitData's chunk files
and ``index.json``, plus our own ``ssl_xcit_shards.json`` written last: the class list, counts and the settings
of ``prepare``. Its presence is what marks the dataset finished, so a folder with chunks but no
``ssl_xcit_shards.json`` is an interrupted ``prepare`` and is refused, never read as a smaller dataset.

Each record is a dict:

- ``image``: the file's original encoded bytes (JPEG, PNG, ...), not re-encoded unless ``prepare --resize-short``
  asked for it, so that decoding can happen in a worker (PIL) or on the GPU (``decode_on: device``);
- ``label``: the class index, -1 when unlabelled;
- ``path``: the image's path relative to the source root (for messages and for ``embed``'s keys).

Plain ``bytes`` rather than LitData's JPEG serializer: that one decodes in the worker, which would rule out GPU
decoding.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from PIL import Image, ImageOps

from ssl_xcit.errors import UserError

META_FILE = "ssl_xcit_shards.json"
FORMAT_VERSION = 1
URL_SCHEMES = ("s3://", "gs://", "azure://")


def is_url(root: str | Path) -> bool:
    return str(root).startswith(URL_SCHEMES)


def is_shard_root(root: str | Path) -> bool:
    """True for a prepared dataset: an object-storage URL, or a local folder with LitData's ``index.json``.

    A local folder with ``index.json`` but without ``ssl_xcit_shards.json`` still counts (so that reading it
    raises the "interrupted prepare" error of :func:`read_meta` instead of scanning chunk files as images).
    """
    if is_url(root):
        return True
    root = Path(root).expanduser()
    return root.is_dir() and ((root / "index.json").is_file() or (root / META_FILE).is_file())


def read_meta(root: str | Path) -> dict[str, Any]:
    """The ``ssl_xcit_shards.json`` of a prepared dataset; a clear error when it is missing or not ours."""
    path = Path(root).expanduser() / META_FILE
    if not path.is_file():
        raise UserError(
            f"{Path(root)} has LitData chunks but no {META_FILE}: an interrupted or foreign `ssl-xcit prepare` "
            "output; run `ssl-xcit prepare SRC OUT` again (it resumes or starts over) before reading it"
        )
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise UserError(
            f"{path}: format {meta.get('format')!r}, this version of ssl-xcit reads {FORMAT_VERSION}"
        )
    return meta


def decode_image(data: bytes, exif_transpose: bool = True) -> Image.Image:
    """Decode a record's encoded bytes into an RGB PIL image (EXIF orientation applied, as for files)."""
    with Image.open(io.BytesIO(data)) as image:
        image.load()  # the full decode, so truncated bytes raise here
        if exif_transpose:
            image = ImageOps.exif_transpose(image)
        return image.convert("RGB")
