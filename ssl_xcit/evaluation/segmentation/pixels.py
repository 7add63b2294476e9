"""Raw pixels as patch tokens: the floor a dense probe on any backbone should clear."""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

__all__ = ["PixelPatches"]


class PixelPatches(nn.Module):
    """Each ``patch x patch`` block of the normalised image, flattened to a (3 * patch**2)-dim token, with the
    backbone interface the probe reads (``size_multiple``, ``forward_patch_tokens``)."""

    def __init__(self, patch: int = 8) -> None:
        super().__init__()
        self.size_multiple = self.patch = patch
        self.name = f"pixels_p{patch}"

    def forward_patch_tokens(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        grid = (x.shape[-2] // self.patch, x.shape[-1] // self.patch)
        return F.unfold(x, self.patch, stride=self.patch).transpose(1, 2), grid

    def extra_repr(self) -> str:  # part of the cache key (module_fingerprint hashes the repr)
        return f"patch={self.patch}"
