"""The built-in dataset: procedurally generated shapes and textures, so the main job runs with no download.

Ten classes (five solid shapes, a ring, a crescent, and three textured patches) are drawn in a random colour, at
a random position, scale and rotation, over a random smooth background (a two-colour gradient or low-frequency
colour noise) with pixel noise. The class is a matter of shape and texture, never of colour or position, so
raw pixels are a poor feature (k-NN on pixels is near chance) and a network has to learn the invariances that
DINO's augmentations teach.

The set is written once, as PNG files in ImageFolder layout (``train/<class>/*.png``, ``val/<class>/*.png``), to
``$SSL_XCIT_CACHE/synthetic_shapes_v1`` (default ``~/.cache/ssl_xcit``). Every image has its own seed
``[version, split, class, index]``, so the pixels are identical on every machine and a smaller
``num_*_per_class`` gives a prefix of the full set. Generation happens in a temporary sibling folder that is
renamed into place only after ``manifest.json`` (the settings and every file's SHA-256) is written: a killed or
concurrent generation never leaves a half dataset that a later run would trust.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from ssl_xcit.utils.io import atomic_write_json, sha256_file

VERSION = 1
CLASSES = (
    "checker", "circle", "crescent", "cross", "dots", "ring", "square", "star", "stripes", "triangle",
)  # fmt: skip
SPLITS = ("train", "val")
DEFAULT_IMAGE_SIZE = 64
DEFAULT_TRAIN_PER_CLASS = 200
DEFAULT_VAL_PER_CLASS = 50
MANIFEST = "manifest.json"
_SUPERSAMPLE = 2  # fixed (the box filter in render_image assumes 2): masks are drawn at 2x and the image is box-downsampled: anti-aliased edges


def cache_dir() -> Path:
    """``$SSL_XCIT_CACHE`` or ``~/.cache/ssl_xcit``: where generated data and feature caches live."""
    return Path(os.environ.get("SSL_XCIT_CACHE") or Path.home() / ".cache" / "ssl_xcit").expanduser()


def default_root(
    image_size: int = DEFAULT_IMAGE_SIZE,
    num_train_per_class: int = DEFAULT_TRAIN_PER_CLASS,
    num_val_per_class: int = DEFAULT_VAL_PER_CLASS,
) -> Path:
    name = f"synthetic_shapes_v{VERSION}"
    if (image_size, num_train_per_class, num_val_per_class) != (
        DEFAULT_IMAGE_SIZE, DEFAULT_TRAIN_PER_CLASS, DEFAULT_VAL_PER_CLASS,
    ):  # fmt: skip
        name += f"_{image_size}px_{num_train_per_class}x{num_val_per_class}"
    return cache_dir() / name


# ---------------------------------------------------------------------------------------------------- drawing
def _background(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, n, 3) float image in [0, 255]: a linear two-colour gradient or bicubic-upsampled colour noise."""
    if rng.random() < 0.5:
        c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
        angle = rng.uniform(0, 2 * math.pi)
        ys, xs = np.mgrid[0:n, 0:n] / (n - 1) - 0.5
        t = np.clip(xs * math.cos(angle) + ys * math.sin(angle) + 0.5, 0, 1)[..., None]
        return c0 * (1 - t) + c1 * t
    cells = int(rng.integers(2, 6))
    grid = rng.uniform(0, 255, (cells, cells, 3)).astype(np.uint8)
    return np.asarray(Image.fromarray(grid).resize((n, n), Image.Resampling.BICUBIC), dtype=np.float64)


def _polygon(cx: float, cy: float, radii: list[float], angle: float) -> list[tuple[float, float]]:
    k = len(radii)
    return [
        (cx + r * math.cos(angle + 2 * math.pi * i / k), cy + r * math.sin(angle + 2 * math.pi * i / k))
        for i, r in enumerate(radii)
    ]


def _shape_mask(name: str, rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, n) float mask in [0, 1] of one shape of class ``name`` at a random position, scale and rotation."""
    r = rng.uniform(0.2, 0.36) * n
    cx, cy = rng.uniform(r, n - r, 2)
    angle = rng.uniform(0, 2 * math.pi)
    mask = Image.new("L", (n, n), 0)
    draw = ImageDraw.Draw(mask)
    disc = lambda rad, x=cx, y=cy: (x - rad, y - rad, x + rad, y + rad)  # noqa: E731
    if name == "circle":
        draw.ellipse(disc(r), fill=255)
    elif name == "ring":
        draw.ellipse(disc(r), fill=255)
        draw.ellipse(disc(r * rng.uniform(0.5, 0.65)), fill=0)
    elif name == "crescent":
        draw.ellipse(disc(r), fill=255)
        shift = r * rng.uniform(0.4, 0.6)
        draw.ellipse(disc(r * 0.9, cx + shift * math.cos(angle), cy + shift * math.sin(angle)), fill=0)
    elif name == "square":
        draw.polygon(_polygon(cx, cy, [r * 0.9] * 4, angle), fill=255)
    elif name == "triangle":
        draw.polygon(_polygon(cx, cy, [r] * 3, angle), fill=255)
    elif name == "star":
        draw.polygon(_polygon(cx, cy, [r, r * 0.42] * 5, angle), fill=255)
    elif name == "cross":
        w = r * 0.33
        arms = [(r, w), (w, w), (w, r), (-w, r), (-w, w), (-r, w),
                (-r, -w), (-w, -w), (-w, -r), (w, -r), (w, -w), (r, -w)]  # fmt: skip
        c, s = math.cos(angle), math.sin(angle)
        draw.polygon([(cx + x * c - y * s, cy + x * s + y * c) for x, y in arms], fill=255)
    else:  # textured square patches: the pattern, not the outline, tells these three apart
        ys, xs = np.mgrid[0:n, 0:n].astype(np.float64)
        c, s = math.cos(angle), math.sin(angle)
        u = (xs - cx) * c + (ys - cy) * s
        v = -(xs - cx) * s + (ys - cy) * c
        half = r * 0.85
        inside = (np.abs(u) <= half) & (np.abs(v) <= half)
        period = 2 * half / rng.choice([3, 4])
        if name == "stripes":
            pattern = np.floor(u / period * 2) % 2 == 0
        elif name == "checker":
            pattern = (np.floor(u / period * 1.5) + np.floor(v / period * 1.5)) % 2 == 0
        elif name == "dots":
            du = (u / period) % 1.0 - 0.5
            dv = (v / period) % 1.0 - 0.5
            pattern = du * du + dv * dv <= 0.3**2
        else:
            raise ValueError(f"unknown synthetic class {name!r}; valid: {CLASSES}")
        return (inside & pattern).astype(np.float64)
    return np.asarray(mask, dtype=np.float64) / 255.0


def render_image(class_name: str, seed: tuple[int, ...], image_size: int = DEFAULT_IMAGE_SIZE) -> Image.Image:
    """The image of ``class_name`` for ``seed``: a deterministic function of its arguments."""
    rng = np.random.default_rng(list(seed))
    n = image_size * _SUPERSAMPLE
    background = _background(rng, n)
    mean_bg = background[::8, ::8].reshape(-1, 3).mean(0)
    # Damp the background's contrast so the shape, not the clutter, dominates the image (learnable in minutes).
    background = mean_bg + (background - mean_bg) * rng.uniform(0.3, 0.7)
    for _ in range(20):  # a foreground colour that stands out from the background, so the shape is visible
        colour = rng.uniform(0, 255, 3)
        if np.linalg.norm(colour - mean_bg) > 90:
            break
    mask = _shape_mask(class_name, rng, n)[..., None]
    image = background * (1 - mask) + colour * mask
    # 2x2 box filter down to the output size.
    image = (image[0::2, 0::2] + image[1::2, 0::2] + image[0::2, 1::2] + image[1::2, 1::2]) / 4
    image += rng.normal(0, rng.uniform(2, 10), image.shape)
    return Image.fromarray(np.clip(np.rint(image), 0, 255).astype(np.uint8))


# --------------------------------------------------------------------------------------------------- the set
def _config(image_size: int, num_train_per_class: int, num_val_per_class: int) -> dict[str, Any]:
    return {
        "name": "synthetic_shapes",
        "version": VERSION,
        "image_size": image_size,
        "num_train_per_class": num_train_per_class,
        "num_val_per_class": num_val_per_class,
        "classes": list(CLASSES),
    }


def generate(
    folder: str | Path,
    image_size: int = DEFAULT_IMAGE_SIZE,
    num_train_per_class: int = DEFAULT_TRAIN_PER_CLASS,
    num_val_per_class: int = DEFAULT_VAL_PER_CLASS,
) -> dict[str, Any]:
    """Write the images into ``folder`` (non-atomically) and return the manifest (not written)."""
    folder = Path(folder)
    files: dict[str, str] = {}
    counts = {"train": num_train_per_class, "val": num_val_per_class}
    for split_index, split in enumerate(SPLITS):
        for class_index, name in enumerate(CLASSES):
            out = folder / split / name
            out.mkdir(parents=True, exist_ok=True)
            for i in range(counts[split]):
                image = render_image(name, (VERSION, split_index, class_index, i), image_size)
                buffer = io.BytesIO()
                image.save(buffer, format="PNG", optimize=False, compress_level=6)
                rel = f"{split}/{name}/{name}_{i:04d}.png"
                (folder / rel).write_bytes(buffer.getvalue())
                files[rel] = sha256_file(folder / rel)
    return {**_config(image_size, num_train_per_class, num_val_per_class), "files": files}


def _read_manifest(root: Path) -> dict[str, Any] | None:
    import json

    try:
        return json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def is_complete(root: str | Path, config: dict[str, Any] | None = None, verify: bool = False) -> bool:
    """Whether ``root`` holds a finished dataset (matching ``config`` if given); ``verify`` rehashes every file."""
    root = Path(root)
    manifest = _read_manifest(root)
    if manifest is None or "files" not in manifest:
        return False
    if config is not None and any(manifest.get(k) != v for k, v in config.items()):
        return False
    for rel, digest in manifest["files"].items():
        path = root / rel
        if not path.is_file() or (verify and sha256_file(path) != digest):
            return False
    return True


def ensure_synthetic_dataset(
    root: str | Path | None = None,
    *,
    image_size: int = DEFAULT_IMAGE_SIZE,
    num_train_per_class: int = DEFAULT_TRAIN_PER_CLASS,
    num_val_per_class: int = DEFAULT_VAL_PER_CLASS,
    verify: bool = False,
) -> Path:
    """The folder of the built-in dataset (``train/`` and ``val/`` ImageFolder trees), generating it if needed.

    ``root`` defaults to a cache folder named after the settings. An explicit ``root`` that exists but is not a
    complete dataset with the same settings raises ``FileExistsError`` rather than being deleted; a stale
    default cache folder is replaced. ``verify`` rehashes every file against the manifest.
    """
    if image_size < 8 or num_train_per_class < 1 or num_val_per_class < 0:
        raise ValueError(
            f"need image_size >= 8, num_train_per_class >= 1, num_val_per_class >= 0; got {image_size}, "
            f"{num_train_per_class}, {num_val_per_class}"
        )
    explicit = root is not None
    root = (
        Path(root).expanduser()
        if explicit
        else default_root(image_size, num_train_per_class, num_val_per_class)
    )
    config = _config(image_size, num_train_per_class, num_val_per_class)
    if is_complete(root, config, verify):
        return root
    if root.exists() and any(root.iterdir()):
        if explicit:
            raise FileExistsError(
                f"{root} exists but is not a complete synthetic dataset with settings {config}; "
                "delete it or pass another folder"
            )
        # Our own stale cache (older settings, tampered files): move it aside atomically, then delete.
        trash = root.with_name(f".{root.name}.stale-{os.getpid()}-{time.time_ns()}")
        with contextlib.suppress(FileNotFoundError):
            os.rename(root, trash)
            shutil.rmtree(trash, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    total = len(CLASSES) * (num_train_per_class + num_val_per_class)
    # One line while it works (about 11 s for the default 2,500 images), so a first run does not look stuck.
    print(
        f"generating the built-in dataset: {total:,} images into {root} (once) ...",
        file=sys.stderr,
        flush=True,
    )
    try:
        manifest = generate(tmp, image_size, num_train_per_class, num_val_per_class)
        atomic_write_json(manifest, tmp / MANIFEST)
        try:
            os.rename(tmp, root)  # replaces root only if it is missing or an empty folder
        except OSError:
            if not is_complete(root, config):  # a concurrent generation won the race with the same result
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root
