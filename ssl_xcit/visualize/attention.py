"""Attention maps of the global query: where the CLS token looks, per head, at image resolution.

Read through the backbone interface (``get_attention_maps``): for a ViT the last block's CLS attention (DINO's
``visualize_attention``), for XCiT and CaiT the class-attention blocks. XCiT has no token-to-token attention
(its attention is channel x channel, xcit#5, dino#79); its class attention is the counterpart.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ssl_xcit.models import Backbone


@torch.no_grad()
def attention_heatmaps(
    model: Backbone, images: Tensor, layer: int = -1, threshold: float | None = None
) -> Tensor:
    """Per-head CLS attention over patches, upsampled to the image: (B, heads, H, W), each map summing to 1.

    Args:
        model: a backbone with ``has_attention_maps``; it is put in eval mode for the call and restored afterwards.
        images: a normalised (B, 3, H, W) batch whose sides are multiples of ``model.size_multiple``.
        layer: which of the returned maps to read (the last by default, as DINO does for ViT).
        threshold: if set, keep per head the smallest set of patches holding this fraction of the attention
            mass (DINO's masks) and return that binary mask instead.
    """
    was_training = model.training
    model.eval()
    try:
        maps, (grid_h, grid_w) = model.get_attention_maps(images)
    finally:
        model.train(was_training)
    attn = maps[layer]
    attn = attn / attn.sum(-1, keepdim=True)
    if threshold is not None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        values, order = attn.sort(dim=-1, descending=True)
        keep_sorted = (values.cumsum(-1) - values) < threshold  # include the patch that crosses the threshold
        attn = torch.zeros_like(attn).scatter(-1, order, keep_sorted.to(attn.dtype))
    batch, heads, _ = attn.shape
    grid = attn.reshape(batch, heads, grid_h, grid_w)
    # Nearest upsampling keeps each value on its own patch, so every map still sums to 1 over patches.
    height, width = images.shape[-2:]
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
