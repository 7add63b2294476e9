"""Attention of the global query over the patch grid, per head, at image resolution (DINO's famous picture).

Everything goes through the backbone interface's ``get_attention_maps``: for XCiT that is the CLS query of the
class-attention blocks (its self-attention is channel x channel, so there is no token-to-token map; xcit#5,
dino#79), for a ViT-like backbone its last-layer CLS attention. Backbones without such a query raise
:class:`~ssl_xcit.models.base.AttentionNotSupported`; :func:`check_attention` turns that into one line.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_xcit.errors import UserError
from ssl_xcit.models.base import AttentionNotSupported
from ssl_xcit.visualize.common import VisualizeError, prepare, progress, read_image


def check_attention(model: nn.Module, kind: str = "attention") -> None:
    """Raise a one-line :class:`VisualizeError` when ``model`` has no attention maps."""
    if not getattr(model, "has_attention_maps", False):
        raise VisualizeError(
            f"backbone {getattr(model, 'name', type(model).__name__)} "
            f"({getattr(model, 'family', '?')}) has no attention maps, so `{kind}` cannot be drawn for it; "
            "the pca and neighbours pictures work for every backbone"
        )


@torch.no_grad()
def attention_heatmaps(
    model: nn.Module, images: Tensor, layer: int = -1, threshold: float | None = None
) -> Tensor:
    """Per-head attention over patches, upsampled to the image: (B, heads, H, W), each map summing to 1.

    Args:
        model: a backbone with attention maps; it is put in eval mode for the call and restored afterwards.
        images: a normalised (B, 3, H, W) batch the backbone accepts (``check_input``).
        layer: which attention block to read (the last by default, as DINO does for ViT).
        threshold: if set, keep per head the smallest set of patches holding this fraction of the attention
            mass (DINO's masks) and return that binary mask instead.
    """
    if threshold is not None and not 0.0 < threshold <= 1.0:
        raise UserError(f"threshold must be in (0, 1], got {threshold}")
    check_attention(model)
    model.check_input(images)
    was_training = model.training
    model.eval()
    try:
        maps, (grid_h, grid_w) = model.get_attention_maps(images)
    except AttentionNotSupported as error:
        raise VisualizeError(str(error)) from error
    finally:
        model.train(was_training)
    attn = maps[layer].float()
    attn = attn / attn.sum(-1, keepdim=True)
    if threshold is not None:
        values, order = attn.sort(dim=-1, descending=True)
        keep_sorted = (values.cumsum(-1) - values) < threshold  # include the patch that crosses the threshold
        attn = torch.zeros_like(attn).scatter(-1, order, keep_sorted.to(attn.dtype))
    batch, heads, _ = attn.shape
    grid = attn.reshape(batch, heads, grid_h, grid_w)
    height, width = images.shape[-2:]
    # Nearest upsampling keeps each value on its own patch, so every map still sums to 1 over the image.
    up = F.interpolate(grid, size=(height, width), mode="nearest")
    return up if threshold is not None else up * (grid_h * grid_w) / (height * width)


def overlay(image: np.ndarray, heatmap: np.ndarray, alpha: float = 0.6, cmap: str = "inferno") -> np.ndarray:
    """Blend a heatmap (H, W) over an RGB uint8 image (H, W, 3); returns uint8 (H, W, 3)."""
    import matplotlib

    if image.shape[:2] != heatmap.shape:
        raise ValueError(f"image {image.shape[:2]} and heatmap {heatmap.shape} differ in size")
    span = float(heatmap.max() - heatmap.min())
    scaled = (heatmap - heatmap.min()) / (span if span > 0 else 1.0)
    colour = matplotlib.colormaps[cmap](scaled)[..., :3] * 255.0
    return (image.astype(np.float64) * (1 - alpha) + colour * alpha).round().clip(0, 255).astype(np.uint8)


def mass_mask(heatmap: Tensor, fraction: float) -> Tensor:
    """Boolean (H, W): the smallest set of pixels holding ``fraction`` of a non-negative heatmap's mass."""
    flat = heatmap.flatten()
    values, order = flat.sort(descending=True)
    keep = (values.cumsum(0) - values) < fraction * flat.sum()
    return torch.zeros_like(flat, dtype=torch.bool).scatter(0, order, keep).reshape(heatmap.shape)


def attention_figure(
    model: nn.Module,
    paths: Sequence[str | os.PathLike],
    size: int = 224,
    layer: int = -1,
    threshold: float = 0.6,
    show_progress: bool = True,
):
    """One row per image: the image, the mean over heads, then every head (heatmap over the image).

    Returns ``(figure, maps)`` with ``maps[i]`` the (heads, H, W) heatmaps of image i.
    """
    import matplotlib.pyplot as plt

    check_attention(model)
    rows = []
    for path in progress(paths, desc="attention", enabled=show_progress):
        x, shown = prepare(read_image(path), size, model.size_multiple)
        maps = attention_heatmaps(model, x[None], layer)[0]
        mask = mass_mask(maps.mean(0), threshold)
        rows.append((shown, maps, mask))
    heads = rows[0][1].shape[0]
    cols = heads + 2
    fig, axes = plt.subplots(len(rows), cols, figsize=(2.2 * cols, 2.2 * len(rows)), squeeze=False)
    for r, (shown, maps, mask) in enumerate(rows):
        panels = [
            (shown, "image"),
            (overlay(shown, maps.mean(0).numpy()), f"mean, {threshold:.0%} mass"),
        ]
        panels += [(overlay(shown, maps[h].numpy()), f"head {h}") for h in range(heads)]
        for c, (picture, title) in enumerate(panels):
            axes[r, c].imshow(picture)
            if c == 1:
                axes[r, c].contour(mask.numpy().astype(float), levels=[0.5], colors="cyan", linewidths=0.8)
            axes[r, c].set_title(title, fontsize=8)
            axes[r, c].axis("off")
    fig.suptitle(f"{model.name}: attention of the global query, layer {layer}, {size} px", fontsize=9)
    fig.tight_layout()
    return fig, [maps for _, maps, _ in rows]
