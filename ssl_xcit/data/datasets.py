"""Image datasets read from an ImageFolder tree, any folder of images, or a text file listing images.

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

import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageOps
from torch.utils.data import Dataset, default_collate

from ssl_xcit.errors import UserError

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm")

Sample = tuple[Path, int]


class UnreadableImageWarning(UserWarning):
    """A file could not be decoded as an image and is skipped."""


def is_image_file(path: str | Path) -> bool:
    return str(path).lower().endswith(IMG_EXTENSIONS)


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
        if bool(self._bad[index]):
            return None
        path, label = self.samples[index]
        # A transform with its own reader (MultiCropGeometry) decodes only the resolution its crops need.
        read = getattr(self.transform, "read", None)
        try:
            image = read(path) if read is not None else load_image(path)
        except Exception as err:  # PIL raises OSError, ValueError, SyntaxError, DecompressionBombError...
            self.mark_unreadable(index, err)
            return None
        if self.transform is not None:
            image = self.transform(image)
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


def _walk_images(folder: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [Path(dirpath) / f for f in filenames if not f.startswith(".") and is_image_file(f)]
    return sorted(found)


def _no_images_error(where: Path) -> UserError:
    return UserError(
        f"no images found in {where}; accepted extensions (case-insensitive): {', '.join(IMG_EXTENSIONS)}"
    )


def scan_folder(root: Path, labelled: bool | None = None) -> tuple[list[Sample], list[str] | None]:
    """Samples of a folder: ImageFolder labels when every image lies in a class subfolder, else unlabelled."""
    if not any(os.scandir(root)):
        raise UserError(f"data folder {root} is empty; expected images (or class subfolders of images)")
    subdirs = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    top_images = [
        e for e in os.scandir(root) if e.is_file() and is_image_file(e.name) and not e.name.startswith(".")
    ]
    if subdirs and not top_images and labelled is not False:
        per_class = {name: _walk_images(root / name) for name in subdirs}
        classes = [name for name in subdirs if per_class[name]]
        if classes:
            samples = [(p, y) for y, name in enumerate(classes) for p in per_class[name]]
            return samples, classes
    if labelled:
        raise UserError(
            f"labels were requested but {root} is not an ImageFolder tree: it needs class subfolders holding "
            "every image and no images directly in the root"
        )
    paths = _walk_images(root)
    if not paths:
        raise _no_images_error(root)
    return [(p, -1) for p in paths], None


def read_list_file(path: Path, labelled: bool | None = None) -> tuple[list[Sample], list[str] | None]:
    """A text file with one image path per line (relative to the file's folder), optionally `` label``.

    Labels are integers (classes become "0".."max") or class names (sorted). Blank lines and ``#`` comments are
    ignored. Missing files raise ``FileNotFoundError`` listing the first few.
    """
    entries: list[tuple[Path, str | None]] = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.rsplit(maxsplit=1)
        whole = path.parent / line
        # "a b.jpg" may be a path with a space; the last token is a label only if the line is not itself a file.
        if len(parts) == 2 and not is_image_file(parts[1]) and not whole.is_file():
            entries.append((path.parent / parts[0], parts[1]))
        else:
            entries.append((whole, None))
    if not entries:
        raise UserError(f"list file {path} names no images (blank lines and # comments are ignored)")
    missing = [str(p) for p, _ in entries if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"list file {path}: {len(missing)} of {len(entries)} listed files do not exist, e.g. "
            + ", ".join(missing[:5])
        )
    has_label = [lab is not None for _, lab in entries]
    if any(has_label) and not all(has_label):
        first = next(str(p) for p, lab in entries if lab is None)
        raise UserError(f"list file {path} mixes lines with and without a label column (e.g. {first})")
    if not all(has_label) or labelled is False:
        if labelled:
            raise UserError(f"labels were requested but list file {path} has no label column")
        return [(p, -1) for p, _ in entries], None
    labels = [lab for _, lab in entries]
    if all(lab.lstrip("-").isdigit() for lab in labels):
        ints = [int(lab) for lab in labels]
        if min(ints) < 0:
            raise UserError(f"list file {path}: labels must be >= 0, got {min(ints)}")
        classes = [str(i) for i in range(max(ints) + 1)]
        return [(p, y) for (p, _), y in zip(entries, ints, strict=True)], classes
    classes = sorted(set(labels))
    index = {name: i for i, name in enumerate(classes)}
    return [(p, index[lab]) for p, lab in entries], classes


def build_dataset(
    root: str | Path, transform: Callable | None = None, labelled: bool | None = None
) -> ImageDataset:
    """An ImageDataset from an ImageFolder tree, any folder of images (recursive), a list file, or a dataset
    written by ``ssl-xcit prepare`` (a :class:`~ssl_xcit.data.shard_dataset.ShardImageDataset`).

    ``labelled``: ``None`` detects labels from the layout, ``False`` ignores them (label -1), ``True`` requires
    them. A missing root raises ``FileNotFoundError``; an empty or image-less one raises ``UserError``.
    """
    from ssl_xcit.data.shards import is_shard_root

    if is_shard_root(root):
        from ssl_xcit.data.shard_dataset import ShardImageDataset

        return ShardImageDataset(root, transform, labelled)
    root = Path(root).expanduser()
    if not root.exists():
        raise FileNotFoundError(
            f"data root {root} does not exist; expected an image folder, an ImageFolder tree or a .txt list file"
        )
    if root.is_dir():
        samples, classes = scan_folder(root, labelled)
    elif is_image_file(root):
        raise UserError(f"data root {root} is a single image; give its folder or a .txt file listing images")
    else:
        samples, classes = read_list_file(root, labelled)
    return ImageDataset(samples, classes, transform)
