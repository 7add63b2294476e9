"""Tiny prepared datasets for the shard tests, written with ``litdata.optimize`` in the record format of
``ssl_xcit.data.shards``: unlike ``prepare`` (which leaves unreadable files out) it can store a record that does
not decode, and it fixes the records per chunk."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from litdata import optimize
from PIL import Image

from ssl_xcit.data.shards import FORMAT_VERSION, META_FILE


def _record(item: tuple[str, bytes, int]) -> dict:
    path, data, label = item
    return {"image": data, "label": label, "path": path}


def jpeg_bytes(seed: int, size: int = 24) -> bytes:
    """A small JPEG whose colour depends on ``seed``."""
    import io

    rng = np.random.default_rng(seed)
    pixels = (rng.integers(0, 60, (size, size, 3)) + rng.integers(0, 190, 3)).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG")
    return out.getvalue()


def make_shards(
    out: Path, n: int, classes: list[str] | None = ("a", "b"), chunk_size: int = 8, bad: tuple[int, ...] = ()
) -> Path:
    """``n`` records (record ``i``: path ``"{i:04d}.jpg"``, label ``i % len(classes)`` or -1), ``chunk_size``
    records a chunk; the records listed in ``bad`` hold bytes that are no image."""
    items = [
        (f"{i:04d}.jpg", b"not an image" if i in bad else jpeg_bytes(i), i % len(classes) if classes else -1)
        for i in range(n)
    ]
    optimize(
        fn=_record, inputs=items, output_dir=str(out), chunk_size=chunk_size, num_workers=1, verbose=False,
        keep_data_ordered=True, reorder_files=False, start_method="fork",
    )  # fmt: skip
    meta = {
        "format": FORMAT_VERSION,
        "id": f"test-{n}",
        "classes": list(classes) if classes else None,
        "records": n,
        "samples": [[path, label] for path, _, label in items],
    }
    (out / META_FILE).write_text(json.dumps(meta))
    return out
