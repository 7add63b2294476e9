"""What every picture kind shares: reading images, sizing them for a backbone, saving PNGs, the HTML page."""

from __future__ import annotations

import base64
import html
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

from ssl_xcit.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from ssl_xcit.errors import UserError


class VisualizeError(UserError):
    """Bad input to a picture (unreadable image, unsupported kind, missing metrics): one line, naming the value."""


def read_image(path: str | os.PathLike) -> Image.Image:
    """An RGB PIL image; a missing or undecodable file raises :class:`VisualizeError` naming it."""
    path = Path(path)
    if not path.is_file():
        raise VisualizeError(f"image not found: {path}")
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise VisualizeError(f"cannot read image {path}: {type(error).__name__}: {error}") from error


def fit_size(width: int, height: int, size: int, multiple: int) -> tuple[int, int]:
    """(width, height) with the longer side ``size`` and both sides rounded to positive multiples of ``multiple``."""
    if size < multiple:
        raise VisualizeError(f"size {size} is smaller than the backbone's size multiple {multiple}")
    scale = size / max(width, height)
    return (
        max(multiple, round(width * scale / multiple) * multiple),
        max(multiple, round(height * scale / multiple) * multiple),
    )


def prepare(image: Image.Image, size: int, multiple: int, square: bool = False) -> tuple[Tensor, np.ndarray]:
    """Resize for a backbone: ``(normalised (3, H, W) tensor, the resized uint8 (H, W, 3) picture)``.

    ``square`` resizes to ``size x size`` (grids of neighbours), otherwise the aspect ratio is kept.
    """
    if square:
        side = fit_size(size, size, size, multiple)[0]
        width, height = side, side
    else:
        width, height = fit_size(*image.size, size, multiple)
    shown = np.asarray(image.resize((width, height), Image.BICUBIC))
    x = torch.from_numpy(shown.copy()).permute(2, 0, 1).float() / 255.0
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    return (x - mean) / std, shown


def save_figure(fig, path: str | os.PathLike, dpi: int = 80) -> Path:
    """Save a matplotlib figure as PNG (parents created) and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight", facecolor="white")
    plt.close(fig)
    return path


def html_page(title: str, pictures: Sequence[tuple[str, str | os.PathLike]]) -> str:
    """One self-contained HTML page: every ``(caption, png)`` inlined as base64, so the file can be mailed alone."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:1400px;margin:auto}img{max-width:100%}</style>",
        f"</head><body><h1>{html.escape(title)}</h1>",
    ]
    for caption, png in pictures:
        data = base64.b64encode(Path(png).read_bytes()).decode("ascii")
        parts.append(
            f"<figure><img alt='{html.escape(caption)}' src='data:image/png;base64,{data}'>"
            f"<figcaption>{html.escape(caption)}</figcaption></figure>"
        )
    parts.append("</body></html>")
    return "\n".join(parts)


def progress(iterable, total: int | None = None, desc: str = "", enabled: bool = True):
    """A tqdm bar on stderr (silent when ``enabled`` is False)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, disable=not enabled, leave=False)
