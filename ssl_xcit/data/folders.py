"""Listing the images of a folder (an ImageFolder tree or any folder, searched recursively) or of a text file
that names them, as ``(path, label)`` samples of an :class:`~ssl_xcit.data.image_dataset.ImageDataset`."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ssl_xcit.data.image_dataset import ImageDataset, Sample
from ssl_xcit.errors import UserError

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm")


def is_image_file(path: str | Path) -> bool:
    return str(path).lower().endswith(IMG_EXTENSIONS)


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


def folder_dataset(
    root: str | Path, transform: Callable | None = None, labelled: bool | None = None
) -> ImageDataset:
    """An ImageDataset from an ImageFolder tree, any folder of images (recursive) or a list file.

    ``labelled``: ``None`` detects labels from the layout, ``False`` ignores them (label -1), ``True`` requires
    them. A missing root raises ``FileNotFoundError``; an empty or image-less one raises ``UserError``.
    """
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
