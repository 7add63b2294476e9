"""CaiT: class-attention image transformer (Touvron et al., ICCV 2021), on timm's :class:`timm.models.cait.Cait`.

timm's modules and parameter names are used as they are (so timm/DeiT checkpoints load strictly both ways). What
this subclass adds for self-supervised use:

* any input size: the learned positional grid is resampled bicubically to the input's patch grid (timm's
  ``resample_abs_pos_embed``; a no-op at the native size, so outputs there equal timm's ``cait_*``);
* ``forward_patch_tokens``: the final-LayerNorm patch tokens (class attention leaves them unchanged);
* ``get_attention_maps``: the class token's attention over the patches in each class-attention block;
* ``get_intermediate_layers`` / ``get_intermediate_cls`` as in XCiT (tokens of chosen self-attention blocks, and
  the CLS that class attention + norm computes from them);
* ``forward_cls_patches_list``: timm's blocks (self- and class-attention) take lists of inputs, each block called
  once for all of them (:class:`~ssl_xcit.models.base.ListForward`; FSDP2 gathers it once: docs/scaling.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from timm.layers import resample_abs_pos_embed
from timm.models import cait
from timm.models.cait import Cait
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ssl_xcit.errors import UserError
from ssl_xcit.models.base import Backbone, ListForward, give_list_forward, input_masks, per_input

# name -> (embed_dim, depth, heads, LayerScale init, paper Table 3 drop path). Head dim is 48 throughout.
# The LayerScale init follows timm/DeiT code where a variant is defined there, else paper Table 3 (backbones.md
# §5: XXS-36 is 1e-5 in code vs 1e-6 in the paper; XS-36, S-48 and M-24 exist only in the paper).
_SHAPES: dict[str, tuple[int, int, int, float, float | None]] = {
    "cait_xxs24": (192, 24, 4, 1e-5, 0.1),
    "cait_xxs36": (192, 36, 4, 1e-5, 0.1),
    "cait_xs24": (288, 24, 6, 1e-5, 0.1),
    "cait_xs36": (288, 36, 6, 1e-6, 0.2),
    "cait_s24": (384, 24, 8, 1e-5, 0.1),
    "cait_s36": (384, 36, 8, 1e-6, 0.2),
    "cait_s48": (384, 48, 8, 1e-6, 0.3),
    "cait_m24": (768, 24, 16, 1e-5, 0.2),
    "cait_m36": (768, 36, 16, 1e-6, 0.3),
    "cait_m48": (768, 48, 16, 1e-6, None),  # the paper gives no ImageNet-only recipe for M-48
}

VARIANTS: dict[str, dict] = {
    name: dict(embed_dim=d, depth=depth, num_heads=heads, init_values=eps)
    for name, (d, depth, heads, eps, _) in _SHAPES.items()
}


class LayerScaleBlock(ListForward, cait.LayerScaleBlock):
    """timm's CaiT self-attention block whose ``forward`` also takes a list of token tensors
    (``forward_cls_patches_list``); same name and parameters. :class:`CaiT` gives its timm blocks this class."""


class LayerScaleBlockClassAttn(ListForward, cait.LayerScaleBlockClassAttn):
    """timm's CaiT class-attention block whose ``forward`` also takes a list of token tensors with the list of
    their class tokens; same name and parameters."""


_LIST_BLOCKS = {
    cait.LayerScaleBlock: LayerScaleBlock,
    cait.LayerScaleBlockClassAttn: LayerScaleBlockClassAttn,
}


class CaiT(Backbone, Cait):
    """timm's Cait with dynamic input size and the :class:`Backbone` accessors.

    Args:
        img_size: native input size; it sets the positional grid (224 -> 14x14) and so the checkpoint layout.
        patch_size, embed_dim, depth, num_heads, init_values: shape and LayerScale init (see ``VARIANTS``).
        num_classes: 0 (default) makes ``forward`` return the CLS embedding.
        kwargs: any other ``timm.models.cait.Cait`` argument (``drop_path_rate``, ``depth_token_only``, ...).
    """

    family = "cait"
    has_attention_maps = True
    supports_masking = True

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        embed_dim: int = 192,
        depth: int = 24,
        num_heads: int = 4,
        init_values: float = 1e-5,
        num_classes: int = 0,
        name: str = "cait",
        **kwargs,
    ) -> None:
        super().__init__(
            img_size=img_size,
            patch_size=patch_size,
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            init_values=init_values,
            num_classes=num_classes,
            **kwargs,
        )
        self.name = name
        self.dense_dim = embed_dim
        self.size_multiple = self.patch_size = patch_size
        self.depth = depth
        self.patch_embed.strict_img_size = False  # sizes are checked (with a clear message) by check_input
        self.takes_input_lists = give_list_forward([*self.blocks, *self.blocks_token_only], _LIST_BLOCKS)

    # ------------------------------------------------------------------ forward
    def _pos_embed_for(self, grid: tuple[int, int]) -> Tensor:
        return resample_abs_pos_embed(
            self.pos_embed,
            new_size=list(grid),
            old_size=list(self.patch_embed.grid_size),
            num_prefix_tokens=0,
        )

    def _embed(self, x: Tensor, mask: Tensor | None = None) -> tuple[Tensor, tuple[int, int]]:
        self.check_input(x)
        grid = (x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size)
        # Non-overlapping patches: replacing a masked patch's embedding hides all of its pixels.
        x = self._apply_mask(self.patch_embed(x), mask) + self._pos_embed_for(grid).to(x.dtype)
        return self.pos_drop(x), grid

    def _run_blocks(self, x: Tensor | list[Tensor], upto: int | None = None) -> list[Tensor]:
        """Outputs of self-attention blocks 0 .. upto (all if None); ``x`` a list: each output the list."""
        outputs = []
        for block in self.blocks[: None if upto is None else upto + 1]:
            if self.grad_checkpointing and torch.is_grad_enabled() and not torch.jit.is_scripting():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
            outputs.append(x)
        return outputs

    def forward_cls(self, x: Tensor) -> Tensor:
        """The class token through the class-attention blocks, prepended to the patch tokens (as timm's
        ``Cait.forward_cls``, which timm releases before 1.0.31 lack)."""
        cls_tokens = self.cls_token.expand(x.shape[0], -1, -1)
        for block in self.blocks_token_only:
            cls_tokens = block(x, cls_tokens)
        return torch.cat((cls_tokens, x), dim=1)

    def forward_features(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """All tokens (B, 1 + N, C) after class attention and the final norm; token 0 is CLS (as timm)."""
        x, _ = self._embed(x, mask)
        return self.norm(self.forward_cls(self._run_blocks(x)[-1]))

    def forward_patch_tokens(self, x: Tensor, mask: Tensor | None = None) -> tuple[Tensor, tuple[int, int]]:
        """Final-norm patch tokens (B, N, C) and their grid; class attention does not change them.
        ``mask`` (B, N) bool replaces masked patches with the mask token (``enable_masking``)."""
        x, grid = self._embed(x, mask)
        return self.norm(self._run_blocks(x)[-1]), grid

    def forward_cls_patches_list(
        self, xs: list[Tensor], masks: list[Tensor | None] | None = None
    ) -> list[tuple[Tensor, Tensor]]:
        """``forward_cls_patches`` of each input, each self-attention and class-attention block called once with
        the list of all inputs' tokens (and of their class tokens)."""
        if not self.takes_input_lists:
            return super().forward_cls_patches_list(xs, masks)
        tokens = [t for t, _ in per_input(self._embed, list(xs), input_masks(xs, masks))]
        tokens = self._run_blocks(tokens)[-1]
        cls_tokens = [self.cls_token.expand(t.shape[0], -1, -1) for t in tokens]
        for block in self.blocks_token_only:
            cls_tokens = block(tokens, cls_tokens)
        tokens = [self.norm(torch.cat((c, t), dim=1)) for c, t in zip(cls_tokens, tokens, strict=True)]
        return [(self.forward_head(t, pre_logits=True), t[:, self.num_prefix_tokens :]) for t in tokens]

    # -------------------------------------------------------- evaluation access
    def get_intermediate_layers(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """Patch tokens (B, N, C) of the chosen self-attention blocks: the last ``n`` if an int, else those."""
        wanted = self._block_indices(n)
        x, _ = self._embed(x)
        outputs = self._run_blocks(x, upto=wanted[-1])
        return [outputs[i] for i in wanted]

    def get_intermediate_cls(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """CLS embeddings (B, C) from class attention + norm on each chosen block's tokens (last one = forward)."""
        return [self.norm(self.forward_cls(t))[:, 0] for t in self.get_intermediate_layers(x, n)]

    def get_dense_layers(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """Patch tokens (B, N, C) of the chosen self-attention blocks after the final norm (class attention
        updates only CLS, so this is what ``forward_features`` gives for the last block)."""
        return [self.norm(t) for t in self.get_intermediate_layers(x, n)]

    def get_attention_maps(self, x: Tensor) -> tuple[list[Tensor], tuple[int, int]]:
        """Per class-attention block, the CLS query's softmax over the patches (B, heads, h*w), and the grid.

        Recomputed from the block's q/k projections because timm's ``ClassAttn`` returns only its output. The
        softmax runs over [CLS, patches] as in the model; the CLS column is then dropped.
        """
        tokens, grid = self._embed(x)
        tokens = self._run_blocks(tokens)[-1]
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)
        maps = []
        for block in self.blocks_token_only:
            u = block.norm1(torch.cat((cls, tokens), dim=1))
            attn = block.attn
            b, n, c = u.shape
            q = attn.q(u[:, :1]).reshape(b, 1, attn.num_heads, c // attn.num_heads).transpose(1, 2)
            k = attn.k(u).reshape(b, n, attn.num_heads, c // attn.num_heads).transpose(1, 2)
            weights = (q * attn.scale @ k.transpose(-2, -1)).softmax(dim=-1)
            maps.append(weights[:, :, 0, 1:])
            cls = block(tokens, cls)
        return maps, grid


def resolve_name(name: str) -> tuple[str, dict] | None:
    """timm's names: ``cait_xxs24_224`` -> ``cait_xxs24``; ``_384``/``_448`` also set that native size."""
    base, _, size = name.rpartition("_")
    if base in VARIANTS and size in ("224", "384", "448"):
        return base, ({} if size == "224" else {"img_size": int(size)})
    return None


def supervised_drop_path(name: str) -> float:
    """Stochastic-depth rate d_r of paper Table 3."""
    rate = _SHAPES[name][4]
    if rate is None:
        raise UserError(f"the CaiT paper gives no drop-path rate for {name}")
    return rate


def describe_variant(name: str) -> dict:
    return {"supervised_drop_path": _SHAPES[name][4]}


def infer_variant(state: Mapping[str, Tensor]) -> tuple[str, dict] | None:
    """``(variant, overrides)`` matching a CaiT state dict: width and depth pick the variant (another depth comes
    back as an override), the positional grid gives ``img_size``."""
    if "pos_embed" not in state or not any(k.startswith("blocks_token_only.") for k in state):
        return None
    width = state["pos_embed"].shape[-1]
    depth = 1 + max((int(k.split(".")[1]) for k in state if k.startswith("blocks.")), default=-1)
    patch = state["patch_embed.proj.weight"].shape[-1] if "patch_embed.proj.weight" in state else 16
    side = round(state["pos_embed"].shape[1] ** 0.5) * patch
    candidates = [n for n, kw in VARIANTS.items() if kw["embed_dim"] == width]
    if not candidates or depth < 1:
        return None
    exact = [n for n in candidates if VARIANTS[n]["depth"] == depth]
    name = exact[0] if exact else min(candidates, key=lambda n: abs(VARIANTS[n]["depth"] - depth))
    overrides = {} if exact else {"depth": depth}
    if side != 224:
        overrides["img_size"] = side
    if patch != 16:
        overrides["patch_size"] = patch
    return name, overrides
