"""Class-attention maps of XCiT: where the CLS token looks, per head, at image resolution.

XCiT has no token-to-token attention map (its attention is channel x channel), so DINO's ``visualize_attention``
does not apply (xcit#5, dino#79). The class-attention blocks do attend over patches: the CLS query's softmax
over the patch tokens is the XCiT counterpart of a ViT's last-layer CLS attention.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ssl_xcit.models import XCiT


@torch.no_grad()
def attention_heatmaps(
    model: XCiT, images: Tensor, layer: int = -1, threshold: float | None = None
) -> Tensor:
    """Per-head CLS attention over patches, upsampled to the image: (B, heads, H, W), each map summing to 1.

    Args:
        model: an XCiT; it is put in eval mode for the call and restored afterwards.
        images: a normalised (B, 3, H, W) batch whose sides are multiples of the patch size.
        layer: which class-attention block to read (the last by default, as DINO does for ViT).
        threshold: if set, keep per head the smallest set of patches holding this fraction of the attention
            mass (DINO's masks) and return that binary mask instead.
    """
    was_training = model.training
    model.eval()
    try:
        maps, (grid_h, grid_w) = model.get_class_attention(images)
    finally:
        model.train(was_training)
    attn = maps[layer][:, :, 1:]  # drop the CLS -> CLS entry
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
    up = F.interpolate(grid, scale_factor=model.patch_size, mode="nearest")
    return up if threshold is not None else up / model.patch_size**2


def overlay(image: np.ndarray, heatmap: np.ndarray, alpha: float = 0.6, cmap: str = "inferno") -> np.ndarray:
    """Blend a heatmap (H, W) over an RGB uint8 image (H, W, 3); returns uint8 (H, W, 3)."""
    import matplotlib

    if image.shape[:2] != heatmap.shape:
        raise ValueError(f"image {image.shape[:2]} and heatmap {heatmap.shape} differ in size")
    span = float(heatmap.max() - heatmap.min())
    scaled = (heatmap - heatmap.min()) / (span if span > 0 else 1.0)
    colour = matplotlib.colormaps[cmap](scaled)[..., :3] * 255.0
    return (image.astype(np.float64) * (1 - alpha) + colour * alpha).round().clip(0, 255).astype(np.uint8)
