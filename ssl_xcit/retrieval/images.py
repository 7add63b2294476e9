"""Images for retrieval: training-set listing, the scaling convention, and the dataset that applies it.

Image scaling convention (one rule for every benchmark, documented in docs/retrieval.md):

* An image is resized so that its longer side is ``resolution`` pixels (up or down), keeping the aspect ratio;
  each side is then rounded to the NEAREST multiple of the patch size (at least one patch). The aspect ratio is
  distorted by at most half a patch per side (< 1.1% at 768 px with 16-px patches).
* A query cropped to its bounding box keeps the scale it has in the full image resized to ``resolution``
  (cirtorch's convention, used by HOW and most CNN retrieval papers): the crop is resized by
  ``resolution / max(full width, full height)``, then rounded to patch multiples the same way.
* JPEGs are decoded with PIL's ``draft`` at the smallest DCT scale that still covers the target size, which
  makes 3264x2448 Holidays photos about 8x cheaper to decode at 768 px and does not change what the network sees
  beyond the resampling filter.

Decoding (EXIF orientation, JPEG draft) is ``ssl_xcit.data.image_dataset.load_image``, shared with training.

The training set (``--train-images``) may be a prepared dataset (``ssl-xcit prepare``): its records stand in for
files as :class:`RecordRef`, decoded by the same code from the record's bytes.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from ssl_xcit.data.datasets import IMG_EXTENSIONS, is_image_file, load_image
from ssl_xcit.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from ssl_xcit.errors import UserError
from ssl_xcit.retrieval.ground_truth import check_files_exist


class RecordRef:
    """Record ``index`` of a prepared dataset (a ``ShardImageDataset``), in place of an image path."""

    def __init__(self, dataset: Any, index: int) -> None:
        self.dataset, self.index = dataset, index

    @property
    def path(self) -> Path:
        """The record's file path relative to the prepared folder, as ``prepare`` read it."""
        return self.dataset.samples[self.index][0]

    @property
    def stem(self) -> str:
        return self.path.stem

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def suffix(self) -> str:
        return self.path.suffix

    def open(self) -> io.BytesIO:
        return io.BytesIO(self.dataset.read_record(self.index)["image"])

    def __str__(self) -> str:
        return f"{self.dataset.root}/{self.path.as_posix()}"

    def key(self) -> list[Any]:
        """What identifies its bytes: the preparation's id (new on every ``prepare``) and the record."""
        return [self.dataset.meta["id"], self.dataset.root, self.dataset.records[self.index]]


def images_fingerprint(paths: Sequence[str | Path | RecordRef]) -> str:
    """The cache key of an image list: ``files_fingerprint`` of files, the preparation and record of records."""
    from ssl_xcit.evaluation.cache import files_fingerprint
    from ssl_xcit.utils.io import sha256_json

    if not any(isinstance(p, RecordRef) for p in paths):
        return files_fingerprint(paths)
    return sha256_json([p.key() if isinstance(p, RecordRef) else str(p) for p in paths])


def list_images(source: str | Path) -> list[Path] | list[RecordRef]:
    """Images of a training set: a folder searched recursively, a .txt file with one path per line, or a
    prepared dataset (its records)."""
    from ssl_xcit.data.shards import is_shard_root

    if is_shard_root(source):
        from ssl_xcit.data.shard_dataset import ShardImageDataset

        dataset = ShardImageDataset(source, labelled=False)
        return [RecordRef(dataset, i) for i in range(len(dataset))]
    source = Path(source)
    if source.is_file():
        lines = [
            ln.split()[0] for ln in source.read_text().splitlines() if ln.strip() and not ln.startswith("#")
        ]
        paths = [p if p.is_absolute() else source.parent / p for p in map(Path, lines)]
        check_files_exist(paths, f"training-set image (listed in {source})")
    elif source.is_dir():
        paths = sorted(p for p in source.rglob("*") if is_image_file(p))
    else:
        raise FileNotFoundError(
            f"training image set not found: {source} (give a folder or a .txt list of paths)"
        )
    if not paths:
        raise FileNotFoundError(f"no images ({', '.join(IMG_EXTENSIONS)}) found in {source}")
    return paths


def target_size(width: float, height: float, scale: float, patch_size: int) -> tuple[int, int]:
    """``(width, height)`` scaled by ``scale``, each side rounded to the nearest patch multiple (>= 1 patch)."""

    def side(v: float) -> int:
        return max(patch_size, int(math.floor(v * scale / patch_size + 0.5)) * patch_size)

    return side(width), side(height)


def load_resized(
    path: str | Path | RecordRef,
    resolution: int,
    patch_size: int,
    bbx: tuple[float, float, float, float] | None = None,
    exif_transpose: bool = True,
    rotation: int = 0,
) -> Image.Image:
    """Decode, orient, optionally crop, and resize an image following the module's scaling convention."""
    source = path.open() if isinstance(path, RecordRef) else Path(path)
    try:
        with Image.open(source) as header:  # reads the header only: the stored size sets the JPEG draft
            stored_w, stored_h = header.size
        scale = resolution / max(stored_w, stored_h)
        # draft keeps both sides >= the request, so ask for the aspect-preserving target size.
        draft = (math.ceil(stored_w * scale), math.ceil(stored_h * scale)) if scale < 1 else None
        if isinstance(source, io.BytesIO):
            source.seek(0)
        im = load_image(source, exif_transpose=exif_transpose, draft=draft)
    except (UnidentifiedImageError, OSError) as err:
        raise UserError(f"cannot read image {path}: {err}") from err
    # decoded = (decoded pixels) / (original pixels): draft scales both axes alike, and max() is unchanged by an
    # EXIF 90-degree turn.
    decoded = max(im.size) / max(stored_w, stored_h)
    if rotation:
        im = im.rotate(rotation, expand=True)
    full_w, full_h = im.width / decoded, im.height / decoded  # in original pixels
    if bbx is not None:
        x1, y1, x2, y2 = (v * decoded for v in bbx)
        box = (
            max(0, round(x1)),
            max(0, round(y1)),
            min(im.width, max(round(x2), round(x1) + 1)),
            min(im.height, max(round(y2), round(y1) + 1)),
        )
        if box[0] >= box[2] or box[1] >= box[3]:
            raise UserError(f"bounding box {bbx} lies outside image {path} ({full_w:.0f}x{full_h:.0f})")
        im = im.crop(box)
        crop_w, crop_h = (box[2] - box[0]) / decoded, (box[3] - box[1]) / decoded
    else:
        crop_w, crop_h = full_w, full_h
    size = target_size(crop_w, crop_h, resolution / max(full_w, full_h), patch_size)
    return im.resize(size, Image.Resampling.BICUBIC)


def to_tensor(im: Image.Image) -> torch.Tensor:
    """(3, H, W) float tensor normalised with the ImageNet mean and std the backbones were trained with."""
    x = torch.from_numpy(np.asarray(im, dtype=np.uint8).copy()).permute(2, 0, 1).float().div_(255)
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    return (x - mean) / std


class ImageList(torch.utils.data.Dataset):
    """Images resized for retrieval; ``__getitem__`` returns ``(tensor (3, H, W), index)``."""

    def __init__(
        self,
        paths: Sequence[Path],
        resolution: int,
        patch_size: int,
        bbx: Sequence[tuple[float, float, float, float] | None] | None = None,
        exif_transpose: bool = True,
        rotations: dict[str, int] | None = None,
    ) -> None:
        self.paths = list(paths)
        self.bbx = list(bbx) if bbx is not None else [None] * len(self.paths)
        self.resolution, self.patch_size = resolution, patch_size
        self.exif_transpose = exif_transpose
        self.rotations = rotations or {}

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        p = self.paths[i] if isinstance(self.paths[i], RecordRef) else Path(self.paths[i])
        im = load_resized(
            p,
            self.resolution,
            self.patch_size,
            self.bbx[i],
            self.exif_transpose,
            self.rotations.get(p.stem, 0),
        )
        return to_tensor(im), i
