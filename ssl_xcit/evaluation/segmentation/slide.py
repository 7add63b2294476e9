"""Sliding-window inference as mmsegmentation's ``slide`` mode runs it (DINOv2: crop 512, stride 341).

Windows start every ``stride`` pixels along each side, ``max(side - crop + stride - 1, 0) // stride + 1`` of
them; a window that would pass the border is moved back inside it, and a side shorter than the crop is taken
whole (the window shrinks to the image). Each window's logits, at the window's size, are summed into the image
and divided by the number of windows covering each pixel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["center_pad", "slide_logits", "window_boxes"]


def _starts(side: int, crop: int, stride: int) -> list[tuple[int, int]]:
    count = max(side - crop + stride - 1, 0) // stride + 1
    spans = []
    for i in range(count):
        end = min(i * stride + crop, side)
        spans.append((max(end - crop, 0), end))
    return spans


def window_boxes(height: int, width: int, crop: int, stride: int) -> list[tuple[int, int, int, int]]:
    """(top, bottom, left, right) of every window, rows first."""
    return [(t, b, l, r) for t, b in _starts(height, crop, stride) for l, r in _starts(width, crop, stride)]  # noqa: E741


def center_pad(image: Tensor, multiple: int) -> Tensor:
    """Pad (..., H, W) with zeros, split evenly on both sides of each axis, to multiples of ``multiple`` (as
    DINOv2's segmentation backbone pads its input for 14-px patches)."""
    pads = []
    for side in (image.shape[-1], image.shape[-2]):
        extra = -side % multiple
        pads += [extra // 2, extra - extra // 2]
    return F.pad(image, pads) if any(pads) else image


def slide_logits(
    window_logits: Callable[[Tensor], Tensor], image: Tensor, num_classes: int, crop: int, stride: int
) -> Tensor:
    """Logits (K, H, W) of one (3, H, W) image: ``window_logits`` maps a batch of equally sized windows
    (n, 3, h, w) to logits (n, K, h, w); overlapping windows are averaged."""
    height, width = image.shape[-2:]
    total = image.new_zeros(num_classes, height, width)
    count = image.new_zeros(1, height, width)
    boxes = window_boxes(height, width, crop, stride)
    by_size: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for box in boxes:
        by_size.setdefault((box[1] - box[0], box[3] - box[2]), []).append(box)
    for same in by_size.values():
        windows = torch.stack([image[:, t:b, l:r] for t, b, l, r in same])  # noqa: E741
        logits = window_logits(windows)
        for (t, b, l, r), part in zip(same, logits, strict=True):  # noqa: E741
            total[:, t:b, l:r] += part.to(total.dtype)
            count[:, t:b, l:r] += 1
    return total / count
