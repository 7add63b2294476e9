"""The one backbone interface every part of ssl_xcit uses (DINO, k-NN, linear probe, retrieval, export, pictures).

A backbone is an ``nn.Module`` with timm's ``forward_features`` / ``forward_head`` split plus the accessors
self-supervised evaluation needs. Nothing outside ``ssl_xcit/models/<family>.py`` may depend on how a family
computes them:

=========================== ==============================================================================
``forward(x)``              the global embedding (B, ``embed_dim``): what DINO's head, k-NN and CLS retrieval use
``forward_patch_tokens(x)`` dense descriptors (B, N, ``dense_dim``) and their grid (h, w), h * w = N
``get_intermediate_layers`` token outputs of chosen blocks (the last ``n`` if an int, else those indices)
``get_intermediate_cls``    global embeddings computed from chosen blocks (ViT-style linear probes)
``get_attention_maps(x)``   per block, the attention of the global query over the patch grid (B, heads, h*w),
                            and the grid; raises :class:`AttentionNotSupported` where there is no such query
``check_input(x)``          ``UserError`` naming the size and the constraint when the input cannot be taken
=========================== ==============================================================================

Class attributes: ``family`` (registry family), ``name`` (registry variant), ``embed_dim``, ``dense_dim``,
``size_multiple`` (input sides must be multiples of it), ``has_attention_maps``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from ssl_xcit.errors import UserError


class AttentionNotSupported(NotImplementedError):
    """The backbone has no attention of a global query over the patch grid (e.g. a pooled CNN-like model)."""


class Backbone(nn.Module):
    """Base class of every registered backbone; see the module docstring for the contract."""

    family: str = ""
    name: str = ""
    embed_dim: int = 0
    dense_dim: int = 0
    size_multiple: int = 1
    size_reason: str = ""  # why sides must be multiples of ``size_multiple``, appended to the size error
    has_attention_maps: bool = False

    def check_input(self, x: Tensor) -> None:
        if x.ndim != 4:
            raise ValueError(f"{self.name} expects a (B, C, H, W) image batch, got shape {tuple(x.shape)}")
        height, width = x.shape[-2:]
        m = self.size_multiple
        if height % m or width % m or height == 0 or width == 0:
            hint = f"{max(m, round(height / m) * m)}x{max(m, round(width / m) * m)}"
            reason = f"; {self.size_reason}" if self.size_reason else ""
            raise UserError(
                f"input size {height}x{width} does not fit {self.name}: both sides must be positive "
                f"multiples of {m} (e.g. {hint}){reason}"
            )

    def _block_indices(self, n: int | Sequence[int], total: int | None = None, detail: str = "") -> list[int]:
        """Sorted non-negative indices of the last ``n`` blocks (an int) or of the given ones (negatives allowed)."""
        total = int(getattr(self, "depth", 0)) if total is None else total
        indices = list(range(total - n, total)) if isinstance(n, int) else [int(i) for i in n]
        bad = [i for i in indices if not -total <= i < total]
        if bad or not indices:
            raise UserError(
                f"block indices {bad or indices} are out of range for {self.name} with {total} blocks{detail}"
            )
        return sorted(i % total for i in indices)

    def forward_patch_tokens(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        raise NotImplementedError

    def get_intermediate_layers(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        raise NotImplementedError

    def get_intermediate_cls(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        raise NotImplementedError

    def get_attention_maps(self, x: Tensor) -> tuple[list[Tensor], tuple[int, int]]:
        raise AttentionNotSupported(
            f"{self.name} ({self.family}) has no attention map of a global query over the patches"
        )
