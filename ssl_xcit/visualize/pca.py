"""PCA of patch tokens as colours (DINOv2's figure): parts of objects get the same colour across images.

DINOv2's recipe: fit a PCA on the patch tokens of several images together; threshold the first component to
separate foreground from background; fit a second PCA on the foreground tokens only and show its first three
components as RGB, background black. Fitting jointly is what makes colours comparable between images.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from ssl_xcit.visualize.common import VisualizeError, prepare, progress, read_image


@dataclass
class PCAPictures:
    """Per image: ``rgb`` (h, w, 3) in [0, 1] on the patch grid, ``foreground`` (h, w) bool."""

    rgb: list[np.ndarray]
    foreground: list[np.ndarray]
    first_component: list[np.ndarray]


def _principal_axes(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    # Exact SVD: a few thousand tokens x a few hundred channels is milliseconds, and pca_lowrank is randomised.
    mean = x.mean(0, keepdim=True)
    _, _, vh = torch.linalg.svd(x - mean, full_matrices=False)
    return mean, vh[:k].T


def _unit(x: Tensor) -> Tensor:
    lo, hi = x.min(0).values, x.max(0).values
    return (x - lo) / torch.where(hi > lo, hi - lo, torch.ones_like(hi))


def _border(h: int, w: int) -> np.ndarray:
    edge = np.zeros((h, w), bool)
    edge[0, :] = edge[-1, :] = edge[:, 0] = edge[:, -1] = True
    return edge


def pca_colours(
    tokens: Sequence[Tensor], grids: Sequence[tuple[int, int]], threshold: float | None = 0.5
) -> PCAPictures:
    """Joint PCA colours of per-image patch tokens ``(N_i, C)`` laid out on ``grids[i] = (h_i, w_i)``.

    ``threshold`` (in [0, 1], on the min-max normalised first component) removes the background; ``None`` keeps
    every patch. The first component's sign is arbitrary; it is oriented so that the image borders, mostly
    background in object photos, score lower than the rest (DINOv2 flips it by hand per figure).
    """
    if threshold is not None and not 0.0 <= threshold < 1.0:
        raise VisualizeError(f"PCA background threshold must be in [0, 1), got {threshold}")
    if not tokens:
        raise VisualizeError("PCA needs at least one image")
    sizes = [t.shape[0] for t in tokens]
    allx = torch.cat([t.float() for t in tokens])
    if allx.shape[0] < 4:
        raise VisualizeError(f"PCA needs at least 4 patches over all images, got {allx.shape[0]}")
    mean, axis = _principal_axes(allx, 1)
    first = ((allx - mean) @ axis)[:, 0]
    border = torch.from_numpy(np.concatenate([_border(*g).ravel() for g in grids]))
    if border.any() and (~border).any() and first[border].mean() > first[~border].mean():
        first = -first
    first = _unit(first[:, None])[:, 0]
    fg = first > threshold if threshold is not None else torch.ones_like(first, dtype=torch.bool)
    if int(fg.sum()) < 3:  # too few foreground patches for three components: colour everything instead
        fg = torch.ones_like(fg)
    mean3, axes3 = _principal_axes(allx[fg], 3)
    rgb = torch.zeros(allx.shape[0], 3)
    proj = (allx[fg] - mean3) @ axes3
    rgb[fg, : proj.shape[1]] = _unit(proj)
    out = PCAPictures([], [], [])
    for part_rgb, part_fg, part_first, (h, w) in zip(
        rgb.split(sizes), fg.split(sizes), first.split(sizes), grids, strict=True
    ):
        out.rgb.append(part_rgb.reshape(h, w, 3).numpy())
        out.foreground.append(part_fg.reshape(h, w).numpy())
        out.first_component.append(part_first.reshape(h, w).numpy())
    return out


@torch.no_grad()
def patch_tokens(
    model: nn.Module, images: Sequence[Tensor], show_progress: bool = True
) -> tuple[list[Tensor], list[tuple[int, int]]]:
    """``forward_patch_tokens`` of each normalised (3, H, W) image, one at a time (sizes may differ)."""
    model.eval()
    tokens, grids = [], []
    for x in progress(images, desc="patch tokens", enabled=show_progress):
        model.check_input(x[None])
        t, grid = model.forward_patch_tokens(x[None])
        tokens.append(t[0])
        grids.append(tuple(grid))
    return tokens, grids


def pca_figure(
    model: nn.Module,
    paths: Sequence[str | os.PathLike],
    size: int = 224,
    threshold: float | None = 0.5,
    show_progress: bool = True,
):
    """Images on top, their jointly fitted PCA colours below; returns ``(figure, PCAPictures)``."""
    import matplotlib.pyplot as plt

    prepared = [prepare(read_image(p), size, model.size_multiple) for p in paths]
    tokens, grids = patch_tokens(model, [x for x, _ in prepared], show_progress)
    pictures = pca_colours(tokens, grids, threshold)
    n = len(prepared)
    fig, axes = plt.subplots(2, n, figsize=(2.4 * n, 5), squeeze=False)
    for i, ((_, shown), rgb) in enumerate(zip(prepared, pictures.rgb, strict=True)):
        axes[0, i].imshow(shown)
        axes[1, i].imshow(rgb, interpolation="nearest", extent=(0, shown.shape[1], shown.shape[0], 0))
        for ax in axes[:, i]:
            ax.axis("off")
    label = "no background removal" if threshold is None else f"background: first component < {threshold}"
    fig.suptitle(f"{model.name}: PCA of patch tokens over {n} images ({label})", fontsize=9)
    fig.tight_layout()
    return fig, pictures
