"""``ImageDataset``: ``(path, label)`` samples decoded on access, and the collation of its batches.

Unreadable files (corrupt, truncated, not an image) never stop a run: ``ImageDataset.__getitem__`` returns
``None`` for them, warns once per file, and ``collate_skip_none`` drops them from the batch.

Counting skipped files with DataLoader workers: each worker holds its own copy of the dataset, so a plain
Python counter incremented in a worker is invisible to the main process. The dataset instead keeps one flag per
sample in a tensor placed in shared memory at construction; workers (forked or spawned: torch shares the storage
when it pickles the dataset) set the flag of a file that fails, so ``num_skipped`` read in the main process counts
every distinct bad file seen by any worker, and a file already flagged is neither decoded nor warned about again
in later epochs. Under DDP every rank has its own flags (sum them across ranks to log a global count).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageOps
from torch.utils.data import Dataset, default_collate

Sample = tuple[Path, int]


class UnreadableImageWarning(UserWarning):
    """A file could not be decoded as an image and is skipped."""


def load_image(
    path: str | Path, exif_transpose: bool = True, draft: tuple[int, int] | None = None
) -> Image.Image:
    """Decode ``path`` fully into an RGB PIL image, applying the EXIF orientation (unless told not to).

    ``draft=(width, height)`` lets a JPEG decode at the smallest DCT scale (1/2, 1/4, 1/8) whose size still
    covers it, which is several times faster for large photos. The one image decoder of the package.
    """
    with Image.open(path) as image:
        if draft is not None and image.format == "JPEG":
            image.draft("RGB", draft)
        image.load()  # the full decode, so a truncated file raises here
        if exif_transpose:
            image = ImageOps.exif_transpose(image)
        return image.convert("RGB")


class ImageDataset(Dataset):
    """``(path, label)`` samples -> ``(transform(image), label, index)``; label is -1 when unlabelled.

    ``classes`` is the sorted list of class names (``None`` for unlabelled data). ``__getitem__`` returns ``None``
    for a file that cannot be decoded (see the module docstring for how the count works with workers).
    """

    def __init__(
        self,
        samples: Sequence[tuple[str | Path, int]],
        classes: list[str] | None,
        transform: Callable[[Image.Image], Any] | None = None,
    ) -> None:
        self.samples: list[Sample] = [(Path(p), int(y)) for p, y in samples]
        self.classes = list(classes) if classes is not None else None
        self.transform = transform
        if self.classes is not None:
            bad = [y for _, y in self.samples if not 0 <= y < len(self.classes)]
            if bad:
                raise ValueError(f"labels {sorted(set(bad))[:5]} are outside 0..{len(self.classes) - 1}")
        self._bad = torch.zeros(len(self.samples), dtype=torch.bool).share_memory_()

    @property
    def labelled(self) -> bool:
        return self.classes is not None

    @property
    def targets(self) -> list[int]:
        return [y for _, y in self.samples]

    @property
    def num_skipped(self) -> int:
        """Number of distinct files found unreadable so far (in this process and its DataLoader workers)."""
        return int(self._bad.sum())

    def skipped_paths(self) -> list[Path]:
        return [self.samples[i][0] for i in self._bad.nonzero().flatten().tolist()]

    def mark_unreadable(self, index: int, error: BaseException | str) -> None:
        """Flag sample ``index`` as unreadable, warning the first time only."""
        if not bool(self._bad[index]):
            self._bad[index] = True
            warnings.warn(
                f"skipping unreadable image {self.samples[index][0]}: {error}",
                UnreadableImageWarning,
                stacklevel=2,
            )

    def verify(self, num_threads: int = 4) -> int:
        """Decode every image once (threads), flagging the unreadable ones before training; returns their number.

        Cheap for small datasets (flowers5: 4,317 images in a few seconds); skip it for ImageNet-sized data,
        where bad files are found lazily during the first epoch instead.
        """
        from concurrent.futures import ThreadPoolExecutor

        def check(i: int) -> tuple[int, BaseException | None]:
            try:
                load_image(self.samples[i][0]).close()
                return i, None
            except Exception as err:  # any decoder failure means "unreadable"
                return i, err

        with ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
            for i, err in pool.map(check, range(len(self.samples))):
                if err is not None:
                    self.mark_unreadable(i, err)
        return self.num_skipped

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int, int] | None:
        return self.load(index, self.transform)

    def load(self, index: int, transform: Callable[..., Any] | None) -> tuple[Any, int, int] | None:
        """Item ``index`` through ``transform`` (the high-resolution stage's size mix picks one per batch)."""
        if bool(self._bad[index]):
            return None
        path, label = self.samples[index]
        # A transform with its own reader (MultiCropGeometry) decodes only the resolution its crops need.
        read = getattr(transform, "read", None)
        try:
            image = read(path) if read is not None else load_image(path)
        except Exception as err:  # PIL raises OSError, ValueError, SyntaxError, DecompressionBombError...
            self.mark_unreadable(index, err)
            return None
        if transform is not None:
            image = transform(image)
        return image, label, index

    def subset(self, indices: Sequence[int], transform: Callable | None | str = "same") -> ImageDataset:
        """A new dataset on ``samples[indices]`` with the same classes (and transform unless given)."""
        return ImageDataset(
            [self.samples[i] for i in indices],
            self.classes,
            self.transform if transform == "same" else transform,
        )

    def __repr__(self) -> str:
        kind = f"{len(self.classes)} classes" if self.classes is not None else "unlabelled"
        return f"ImageDataset({len(self)} images, {kind})"


def collate_skip_none(batch: list[Any]) -> Any:
    """``default_collate`` after dropping the ``None`` items of unreadable files; ``None`` if nothing is left.

    A multi-crop batch collates to ``[crops, labels, indices]`` with ``crops`` a list of (B, 3, H, W) tensors.
    """
    batch = [item for item in batch if item is not None]
    if not batch:
        return None
    return default_collate(batch)


class EmptyBatch:
    """A training batch whose images were all unreadable. Lightning silently skips a ``None`` batch without
    calling ``training_step``, so under DDP that rank would miss the collectives the other ranks enter and
    hang them; this marker reaches ``training_step``, where every rank agrees to skip the step together."""

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "EmptyBatch()"


def collate_train(batch: list[Any]) -> Any:
    """:func:`collate_skip_none` for training loaders: an :class:`EmptyBatch` instead of ``None``."""
    out = collate_skip_none(batch)
    return EmptyBatch() if out is None else out
