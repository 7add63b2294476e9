"""Raw pixels as patch tokens: the floor a dense probe on any backbone should clear."""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ssl_xcit.errors import UserError

__all__ = ["PixelPatches"]


class PixelPatches(nn.Module):
    """Each ``patch x patch`` block of the normalised image, flattened to a (3 * patch**2)-dim token, with the
    backbone interface the probe reads (``size_multiple``, ``get_dense_layers``; one "block")."""

    def __init__(self, patch: int = 8) -> None:
        super().__init__()
        self.size_multiple = self.patch = patch
        self.name = f"pixels_p{patch}"

    def forward_patch_tokens(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        grid = (x.shape[-2] // self.patch, x.shape[-1] // self.patch)
        return F.unfold(x, self.patch, stride=self.patch).transpose(1, 2), grid

    def get_dense_layers(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        if n not in (1, [0], [-1]):
            raise UserError(f"raw pixels are one layer; got {n} (use --layers 1)")
        return [self.forward_patch_tokens(x)[0]]

    def extra_repr(self) -> str:  # part of the cache key (module_fingerprint hashes the repr)
        return f"patch={self.patch}"
