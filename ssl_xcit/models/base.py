"""The one backbone interface every part of ssl_xcit uses (DINO, k-NN, linear probe, retrieval, export, pictures).

A backbone is an ``nn.Module`` with timm's ``forward_features`` / ``forward_head`` split plus the accessors
self-supervised evaluation needs. Nothing outside ``ssl_xcit/models/<family>.py`` may depend on how a family
computes them:

=========================== ==============================================================================
``forward(x)``              the global embedding (B, ``embed_dim``): what DINO's head, k-NN and CLS retrieval use
``forward_patch_tokens(x)`` dense descriptors (B, N, ``dense_dim``) and their grid (h, w), h * w = N
``get_intermediate_layers`` token outputs of chosen blocks (the last ``n`` if an int, else those indices)
``get_intermediate_cls``    global embeddings computed from chosen blocks (ViT-style linear probes)
``get_dense_layers(x, n)``  final-norm patch tokens of the chosen blocks: each block's tokens as the network
                            outputs them had it ended there (DINOv2's ``get_intermediate_layers(norm=True)``)
``get_attention_maps(x)``   per block, the attention of the global query over the patch grid (B, heads, h*w),
                            and the grid; raises :class:`AttentionNotSupported` where there is no such query
``check_input(x)``          ``UserError`` naming the size and the constraint when the input cannot be taken
``forward_cls_patches``     ``(x, mask=None)``: the final-norm global embedding and patch tokens of one pass;
                            with a mask (B, h*w), masked patches are replaced by a learnt mask token (iBOT)
``token_grid(h, w)``        the patch grid (h', w') of an input size
=========================== ==============================================================================

``forward_cls_patches_list(xs, masks=None)`` gives ``forward_cls_patches`` of each input of a plain list, each
computed exactly as alone; with ``takes_input_lists`` each block is called once with the list of all inputs' tokens
(FSDP2 then gathers it once for all of them: docs/scaling.md), else one pass per input.

Masking (iBOT, ``supports_masking``): ``enable_masking()`` adds the ``mask_token`` parameter; XCiT, ViT and CaiT
replace the embedding of each masked patch with it after patch embedding and before the positional encoding
(as iBOT and DINOv2 do), DINOv3's ViTs before the prefix tokens and the RoPE of attention (as DINOv3 does), and ``forward_patch_tokens`` / ``forward_features`` take the same optional mask.

Class attributes: ``family`` (registry family), ``name`` (registry variant), ``embed_dim``, ``dense_dim``,
``size_multiple`` (input sides must be multiples of it), ``has_attention_maps``, ``gives_patch_tokens``
(``forward_cls_patches`` works without a mask: true wherever masking is, and for ConvNeXt), ``takes_input_lists``
(every family: blocks whose ``forward`` also takes a list of inputs, :class:`ListForward`; false for a timm ViT,
DINOv3 ViT, CaiT or ConvNeXt built with other block classes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ssl_xcit.errors import UserError


class AttentionNotSupported(NotImplementedError):
    """The backbone has no attention of a global query over the patch grid (e.g. a pooled CNN-like model)."""


MASKING_FAMILIES = ("xcit", "vit", "cait", "dinov3")
# Families whose forward_cls_patches gives the final-norm patch tokens of one pass (Gram anchoring reads them).
PATCH_TOKEN_FAMILIES = (*MASKING_FAMILIES, "convnext")


class _ListInput:
    """Which input of a list forward (:func:`per_input`) is being computed; None outside one."""

    index: int | None = None


def list_input() -> int | None:
    """The index of the input a list forward is computing now (None outside one): iBOT's masked BatchNorm
    statistics (``ssl_xcit.dino.masked_bn``) apply to the masked input of a list only."""
    return _ListInput.index


def per_input(forward: Callable[..., Any], xs: list[Tensor], *args: Any, **kwargs: Any) -> list[Any]:
    """``forward`` on each input of the plain list ``xs``, in order, each computed exactly as alone. Every other
    argument that is a list gives each input its own element (XCiT's grid sides, DINOv3's RoPE); any other is
    passed to every input."""
    n = len(xs)
    for value in (*args, *kwargs.values()):
        if isinstance(value, list) and len(value) != n:
            raise ValueError(f"a list forward of {n} inputs got a per-input argument of {len(value)}")

    def pick(value: Any, i: int) -> Any:
        return value[i] if isinstance(value, list) else value

    outer = _ListInput.index
    outputs = []
    try:
        for i, x in enumerate(xs):
            _ListInput.index = i
            outputs.append(
                forward(x, *(pick(a, i) for a in args), **{k: pick(v, i) for k, v in kwargs.items()})
            )
    finally:
        _ListInput.index = outer
    return outputs


class ListForward:
    """Mixin for a block class (first base, before the block's own class): ``forward`` also takes a plain list of
    inputs and returns the list of what each input alone gives (:func:`per_input`). One call of the block then
    serves every input, so FSDP2, whose hooks run once per call of a sharded module, gathers it once in forward
    and once in backward for all of them, as DINOv3's blocks taking lists. The class adds no module or
    parameter: state dict keys are the block's own. A plain ``list`` (FSDP2 flattens it with pytree; a list
    subclass would be one leaf, and the backward hooks would miss its tensors)."""

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(x, list):
            return per_input(super().forward, x, *args, **kwargs)  # type: ignore[misc]
        return super().forward(x, *args, **kwargs)  # type: ignore[misc]


def give_list_forward(blocks: Iterable[nn.Module], classes: dict[type, type]) -> bool:
    """Give each block whose class is a key of ``classes`` (a timm block class) its list-taking subclass (the
    value, :class:`ListForward` first) in place: no new module, so parameter names are unchanged. Returns
    whether every block now takes lists (a model built with other block classes keeps a pass per input)."""
    blocks = list(blocks)
    for block in blocks:
        if type(block) in classes:
            block.__class__ = classes[type(block)]
    return all(type(b) in classes.values() for b in blocks)


def input_masks(xs: Sequence[Tensor], masks: Sequence[Tensor | None] | None) -> list[Tensor | None]:
    """``masks`` as a list with one entry per input (None: no input masked)."""
    if masks is None:
        return [None] * len(xs)
    if len(masks) != len(xs):
        raise ValueError(f"{len(xs)} inputs got {len(masks)} masks (None for an unmasked input)")
    return list(masks)


class MaskingNotSupported(UserError):
    """The family has no per-patch token to replace with a mask token (iBOT's masked patch term)."""


class Backbone(nn.Module):
    """Base class of every registered backbone; see the module docstring for the contract."""

    family: str = ""
    name: str = ""
    embed_dim: int = 0
    dense_dim: int = 0
    size_multiple: int = 1
    size_reason: str = ""  # why sides must be multiples of ``size_multiple``, appended to the size error
    has_attention_maps: bool = False
    supports_masking: bool = False
    gives_patch_tokens: bool = False  # forward_cls_patches gives final-norm patch tokens (implied by masking)
    masking_refusal: str = ""  # why the family cannot be masked, appended to MaskingNotSupported
    takes_input_lists: bool = False  # forward_cls_patches_list calls each block once for all inputs

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

    def token_grid(self, height: int, width: int) -> tuple[int, int]:
        """The patch grid of an input of this size (families with one token per patch)."""
        return height // self.size_multiple, width // self.size_multiple

    def enable_masking(self) -> None:
        """Add the learnt ``mask_token`` (zeros at start, as in iBOT and DINOv2) that masked patches take.

        Called by DINO when the iBOT term is on; a backbone without it keeps the plain checkpoint layout."""
        if not self.supports_masking:
            reason = f": {self.masking_refusal}" if self.masking_refusal else ""
            raise MaskingNotSupported(
                f"{self.family} backbones ({self.name}) cannot take iBOT's patch masks{reason}; "
                f"masking works with the {', '.join(MASKING_FAMILIES)} families (or set ibot_loss_weight: 0)"
            )
        if getattr(self, "mask_token", None) is None:
            self.mask_token = nn.Parameter(torch.zeros(1, self.embed_dim))

    def _apply_mask(self, tokens: Tensor, mask: Tensor | None) -> Tensor:
        """``tokens`` (B, N, C) or (B, h, w, C) with each masked patch replaced by ``mask_token``."""
        if mask is None:
            return tokens
        if getattr(self, "mask_token", None) is None:
            raise RuntimeError(
                f"{self.name} got a patch mask but has no mask token; call enable_masking() first"
            )
        grid_shape = tokens.shape[:-1]
        self._check_mask(mask, grid_shape)
        mask = mask.reshape(grid_shape).unsqueeze(-1)
        return torch.where(mask, self.mask_token.to(tokens.dtype).reshape(-1), tokens)

    def _check_mask(self, mask: Tensor, grid_shape: Sequence[int]) -> None:
        """A bool mask (B, h*w) matching ``grid_shape`` = (B, N) or (B, h, w), else a ValueError naming both."""
        if (
            mask.dtype != torch.bool
            or mask.numel() != math.prod(grid_shape)
            or mask.shape[0] != grid_shape[0]
        ):
            raise ValueError(
                f"patch mask of shape {tuple(mask.shape)} ({mask.dtype}) does not match the token grid "
                f"{tuple(grid_shape)} of {self.name}; expected a bool mask (B, h*w)"
            )

    def forward_cls_patches(self, x: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The global embedding (B, ``embed_dim``) and the final-norm patch tokens (B, h*w, C) of one pass."""
        tokens = self.forward_features(x, mask=mask)
        prefix = int(getattr(self, "num_prefix_tokens", 1))
        return self.forward_head(tokens, pre_logits=True), tokens[:, prefix:]

    def forward_cls_patches_list(
        self, xs: list[Tensor], masks: list[Tensor | None] | None = None
    ) -> list[tuple[Tensor, Tensor]]:
        """``forward_cls_patches(x, mask)`` of each input of ``xs`` (with its mask, None for none). Here one
        pass per input; families with ``takes_input_lists`` run each block once with all inputs' tokens."""
        return [self.forward_cls_patches(x, mask=m) for x, m in zip(xs, input_masks(xs, masks), strict=True)]

    def get_intermediate_layers(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        raise NotImplementedError

    def get_intermediate_cls(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        raise NotImplementedError

    def get_dense_layers(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """Final-norm patch tokens (B, N_i, C_i) of the chosen blocks (the last ``n`` if an int): what the
        segmentation probe reads. Each is what the family's final stage (norm, and XCiT's class attention)
        makes of that block's tokens, so ``n=1`` gives the network's own final-norm patch tokens."""
        raise NotImplementedError

    def get_attention_maps(self, x: Tensor) -> tuple[list[Tensor], tuple[int, int]]:
        raise AttentionNotSupported(
            f"{self.name} ({self.family}) has no attention map of a global query over the patches"
        )
