"""XCiT: cross-covariance image transformer (El-Nouby et al., NeurIPS 2021).

Data path: convolutional patch embedding -> + Fourier positional encoding -> XCA blocks (patch tokens only) ->
prepend CLS -> two class-attention blocks -> LayerNorm -> CLS embedding (-> optional linear head).

Besides the CLS embedding the model exposes what evaluation needs: the patch tokens before class attention
(``forward_patch_tokens``, for VLAD/ASMK), outputs of chosen XCA blocks (``get_intermediate_layers``), CLS
embeddings computed from earlier blocks (``get_intermediate_cls``, for linear probes), and the class-attention
maps per head (``get_class_attention``, for visualisation).

Which parts are timm's modules and which are ours (and why: measured speed, or attention weights the interface
needs) is listed in :mod:`ssl_xcit.models.layers`. The official-checkpoint renames go through timm's
``checkpoint_filter_fn`` (:func:`convert_state_dict`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from timm.layers import trunc_normal_
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ssl_xcit.errors import UserError
from ssl_xcit.models import layers
from ssl_xcit.models.base import Backbone, ListForward, input_masks, per_input
from ssl_xcit.models.layers import PositionalEncodingFourier, conv_patch_embed


class XCABlock(ListForward, layers.XCABlock):
    """:class:`ssl_xcit.models.layers.XCABlock` whose ``forward`` also takes a list of token tensors, with lists
    of their grid sides (``forward_cls_patches_list``); same name and parameters."""


class ClassAttentionBlock(ListForward, layers.ClassAttentionBlock):
    """:class:`ssl_xcit.models.layers.ClassAttentionBlock` whose ``forward`` also takes a list of token tensors
    and returns the list of its ``(tokens, attention)`` pairs; same name and parameters."""


class XCiT(Backbone):
    """Cross-covariance image transformer with timm-compatible parameter names.

    Args:
        patch_size: 16 or 8; inputs must have sides that are multiples of it.
        in_chans: input channels.
        num_classes: size of the linear head; 0 (the default for self-supervised use) makes ``forward`` return the
            CLS embedding.
        embed_dim, depth, num_heads, mlp_ratio, qkv_bias: transformer shape.
        drop_rate: dropout before the head and inside the class-attention blocks.
        pos_drop_rate, proj_drop_rate, attn_drop_rate: dropout after the positional encoding, on projections of the
            XCA blocks, and on the attention matrices.
        drop_path_rate: stochastic-depth rate, the same for every XCA block (as in the paper's code); the
            class-attention blocks get none.
        cls_attn_layers: number of class-attention blocks.
        use_pos_embed: add the 2-D Fourier positional encoding.
        eta: LayerScale initial value (paper Table B.1: 1.0 for 12-layer models, 1e-5 for 24-layer ones).
        tokens_norm: normalise every token (not only CLS) inside the class-attention blocks.
        name: registry name, kept for error messages and checkpoint metadata.
    """

    family = "xcit"
    has_attention_maps = True
    supports_masking = True
    takes_input_lists = True

    def __init__(
        self,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 0,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        cls_attn_layers: int = 2,
        use_pos_embed: bool = True,
        eta: float = 1.0,
        tokens_norm: bool = False,
        name: str = "xcit",
    ) -> None:
        super().__init__()
        self.name = name
        self.num_classes = num_classes
        self.num_features = self.embed_dim = embed_dim
        self.patch_size = self.size_multiple = patch_size
        self.dense_dim = embed_dim
        self.depth = depth
        self.num_heads = num_heads
        self.grad_checkpointing = False

        self.patch_embed = conv_patch_embed(patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = PositionalEncodingFourier(dim=embed_dim) if use_pos_embed else None
        self.pos_drop = nn.Dropout(pos_drop_rate)
        self.blocks = nn.ModuleList(
            XCABlock(
                embed_dim,
                num_heads,
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                proj_drop=proj_drop_rate,
                attn_drop=attn_drop_rate,
                drop_path=drop_path_rate,
                eta=eta,
            )
            for _ in range(depth)
        )
        self.cls_attn_blocks = nn.ModuleList(
            ClassAttentionBlock(
                embed_dim,
                num_heads,
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                proj_drop=drop_rate,
                attn_drop=attn_drop_rate,
                eta=eta,
                tokens_norm=tokens_norm,
            )
            for _ in range(cls_attn_layers)
        )
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

        trunc_normal_(self.cls_token, std=0.02)
        self.apply(_init_weights)

    # ----------------------------------------------------------------- utilities
    def check_input(self, x: Tensor) -> None:
        """Raise a UserError naming the size and the patch when the input cannot be tiled by patches."""
        if x.ndim != 4:
            raise ValueError(
                f"{self.name} expects a (B, C, H, W) image batch, got a tensor of shape {tuple(x.shape)}"
            )
        height, width = x.shape[-2:]
        p = self.patch_size
        if height % p or width % p or height == 0 or width == 0:
            hint = f"{max(p, round(height / p) * p)}x{max(p, round(width / p) * p)}"
            raise UserError(
                f"input size {height}x{width} is not a multiple of the patch size {p} of {self.name}; "
                f"both sides must be positive multiples of {p} (e.g. {hint})"
            )

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute XCA block activations in the backward pass: less memory for high resolutions."""
        self.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token"}

    # ------------------------------------------------------------------ forward
    def _embed(self, x: Tensor, mask: Tensor | None = None) -> tuple[Tensor, tuple[int, int]]:
        self.check_input(x)
        if mask is not None:
            # The convolutional stem's receptive field (31 px for 16-px patches, 15 px for 8-px ones) reaches
            # into neighbouring patches, so replacing a masked patch's embedding alone would still let its
            # border pixels into the unmasked neighbours' embeddings. Blanking the masked patches' pixels
            # first makes their content invisible everywhere, as iBOT's non-overlapping ViT stem guarantees
            # (docs/ibot.md, tests/models/test_patch_masking.py).
            p = self.patch_size
            grid = (x.shape[0], x.shape[-2] // p, x.shape[-1] // p)
            self._check_mask(mask, grid)
            hidden = mask.reshape(grid).unsqueeze(1)
            hidden = hidden.repeat_interleave(p, dim=2).repeat_interleave(p, dim=3)
            x = x.masked_fill(hidden, 0.0)
        x, (height, width) = self.patch_embed(x)
        x = self._apply_mask(x, mask)
        if self.pos_embed is not None:
            x = x + self.pos_embed(height, width).to(x.dtype)
        return self.pos_drop(x), (height, width)

    def _run_block(
        self, block: XCABlock, x: Tensor | list[Tensor], height: int | list[int], width: int | list[int]
    ) -> Tensor | list[Tensor]:
        if self.grad_checkpointing and torch.is_grad_enabled() and not torch.jit.is_scripting():
            return checkpoint(block, x, height, width, use_reentrant=False)
        return block(x, height, width)

    def _class_attention(self, x: Tensor, return_attention: bool = False) -> tuple[Tensor, list[Tensor]]:
        """Prepend CLS to the patch tokens, run the class-attention blocks and the final norm."""
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x), dim=1)
        maps = []
        for block in self.cls_attn_blocks:
            x, attn = block(x, return_attention=return_attention)
            if attn is not None:
                maps.append(attn)
        return self.norm(x), maps

    def forward_patch_tokens(self, x: Tensor, mask: Tensor | None = None) -> tuple[Tensor, tuple[int, int]]:
        """Patch tokens (B, N, C) after the last XCA block, before class attention, and the grid (Hp, Wp).
        ``mask`` (B, N) bool replaces masked patches with the mask token (``enable_masking``)."""
        x, (height, width) = self._embed(x, mask)
        for block in self.blocks:
            x = self._run_block(block, x, height, width)
        return x, (height, width)

    def forward_features(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """All tokens (B, 1 + N, C) after class attention and the final norm; token 0 is CLS."""
        x, _ = self.forward_patch_tokens(x, mask)
        return self._class_attention(x)[0]

    def forward_cls_patches_list(
        self, xs: list[Tensor], masks: list[Tensor | None] | None = None
    ) -> list[tuple[Tensor, Tensor]]:
        """``forward_cls_patches`` of each input, each XCA and class-attention block called once with the list
        of all inputs' tokens; the stem (and its BatchNorm statistics) runs per input, as in separate passes."""
        embedded = per_input(self._embed, list(xs), input_masks(xs, masks))
        tokens = [t for t, _ in embedded]
        heights, widths = [h for _, (h, _) in embedded], [w for _, (_, w) in embedded]
        for block in self.blocks:
            tokens = self._run_block(block, tokens, heights, widths)
        tokens = [
            torch.cat((self.cls_token.expand(t.shape[0], -1, -1).to(t.dtype), t), dim=1) for t in tokens
        ]
        for block in self.cls_attn_blocks:
            tokens = [t for t, _ in block(tokens)]
        tokens = [self.norm(t) for t in tokens]
        return [(self.forward_head(t, pre_logits=True), t[:, 1:]) for t in tokens]

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = self.head_drop(x[:, 0])
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        """CLS embedding (B, C) when ``num_classes == 0``, class logits otherwise."""
        return self.forward_head(self.forward_features(x))

    # -------------------------------------------------------- evaluation access
    def get_intermediate_layers(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """Patch tokens (B, N, C) output by the chosen XCA blocks: the last ``n`` if an int, else those indices."""
        wanted = self._block_indices(n)
        x, (height, width) = self._embed(x)
        outputs = []
        for i, block in enumerate(self.blocks[: wanted[-1] + 1]):
            x = self._run_block(block, x, height, width)
            if i in wanted:
                outputs.append(x)
        return outputs

    def get_intermediate_cls(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """CLS embeddings (B, C) obtained by running class attention + norm on the output of each chosen block.

        For the last block this equals ``forward`` of a headless model. Used for ViT-style "CLS of the last n
        blocks" linear probes.
        """
        return [self._class_attention(tokens)[0][:, 0] for tokens in self.get_intermediate_layers(x, n)]

    def get_dense_layers(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """Patch tokens (B, N, C) of each chosen XCA block after class attention and the final norm (class
        attention changes the patch tokens too: they take their norm1 residual), as ``forward_features``
        gives them for the last block."""
        return [self._class_attention(t)[0][:, 1:] for t in self.get_intermediate_layers(x, n)]

    def get_attention_maps(self, x: Tensor) -> tuple[list[Tensor], tuple[int, int]]:
        """Backbone interface: the CLS query's attention over the patch grid, (B, heads, h*w) per block."""
        maps, grid = self.get_class_attention(x)
        return [m[..., 1:] for m in maps], grid

    def get_class_attention(self, x: Tensor) -> tuple[list[Tensor], tuple[int, int]]:
        """Attention of the CLS query over [CLS, patches] per class-attention block: (B, heads, 1 + N) each."""
        tokens, grid = self.forward_patch_tokens(x)
        return self._class_attention(tokens, return_attention=True)[1], grid


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


# --------------------------------------------------------------------------------------------- variants
@dataclass(frozen=True)
class XCiTSize:
    """Shape of one XCiT family member.

    ``eta`` is the LayerScale init and ``supervised_drop_path`` the stochastic-depth rate of paper Table B.1
    (the supervised ImageNet recipe; DINO recipes set their own). ``tokens_norm`` follows the released
    checkpoints: every size but nano normalises all tokens in class attention.
    """

    embed_dim: int
    depth: int
    num_heads: int
    eta: float
    tokens_norm: bool
    supervised_drop_path: dict[int, float]


SIZES: dict[str, XCiTSize] = {
    "nano_12": XCiTSize(128, 12, 4, 1.0, False, {16: 0.0, 8: 0.0}),
    "tiny_12": XCiTSize(192, 12, 4, 1.0, True, {16: 0.0, 8: 0.0}),
    "tiny_24": XCiTSize(192, 24, 4, 1e-5, True, {16: 0.05, 8: 0.05}),
    "small_12": XCiTSize(384, 12, 8, 1.0, True, {16: 0.05, 8: 0.05}),
    "small_24": XCiTSize(384, 24, 8, 1e-5, True, {16: 0.1, 8: 0.1}),
    "medium_24": XCiTSize(512, 24, 8, 1e-5, True, {16: 0.15, 8: 0.15}),
    "large_24": XCiTSize(768, 24, 16, 1e-5, True, {16: 0.25, 8: 0.3}),
}
PATCH_SIZES = (16, 8)

# Registry table (name -> constructor kwargs), read by ssl_xcit.models.registry.
VARIANTS: dict[str, dict] = {
    f"xcit_{size}_p{patch}": dict(
        patch_size=patch,
        embed_dim=spec.embed_dim,
        depth=spec.depth,
        num_heads=spec.num_heads,
        eta=spec.eta,
        tokens_norm=spec.tokens_norm,
    )
    for size, spec in SIZES.items()
    for patch in PATCH_SIZES
}


def resolve_name(name: str) -> tuple[str, dict] | None:
    """timm's spelling ``xcit_small_12_p16_224`` -> ``xcit_small_12_p16`` (XCiT has no size-bound weights)."""
    for suffix in ("_224", "_384", "_448"):
        if name.endswith(suffix) and name[: -len(suffix)] in VARIANTS:
            return name[: -len(suffix)], {}
    return None


def _size_of(name: str) -> str:
    return name[len("xcit_") : name.rindex("_p")]


def supervised_drop_path(name: str) -> float:
    """Stochastic-depth rate of paper Table B.1 for a registered XCiT variant."""
    return SIZES[_size_of(name)].supervised_drop_path[VARIANTS[name]["patch_size"]]


def describe_variant(name: str) -> dict:
    """Registry facts (shape, LayerScale init, Table B.1 drop path) for summaries."""
    info = {k: v for k, v in SIZES[_size_of(name)].__dict__.items() if k != "supervised_drop_path"}
    return dict(
        info, patch_size=VARIANTS[name]["patch_size"], supervised_drop_path=supervised_drop_path(name)
    )


def convert_state_dict(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Official XCiT/DINO naming (``pos_embeder``, fused class-attention ``qkv``) -> ours, by timm's filter."""
    from timm.models.xcit import checkpoint_filter_fn

    state = dict(state_dict)
    blocks = {int(m.group(1)) for k in state if (m := re.match(r"cls_attn_blocks\.(\d+)\.", k))}
    # timm's filter asks the model only whether it has a pos_embed, how many class-attention blocks it has and
    # whether they are split into q/k/v (ours always are), so a stand-in avoids building the model.
    shape = SimpleNamespace(
        pos_embed=True,
        cls_attn_blocks=range(1 + max(blocks, default=-1)),
        state_dict=lambda: {"cls_attn_blocks.0.attn.q.weight": None},
    )
    return checkpoint_filter_fn(state, shape)


def infer_variant(state: Mapping[str, Tensor]) -> tuple[str, dict] | None:
    """``(variant, overrides)`` matching an XCiT state dict's shapes, or ``None``; a non-registered depth (a
    truncated model) comes back as a ``depth`` override."""
    token = state.get("cls_token")
    if token is None or not any(k.startswith("cls_attn_blocks.") for k in state):
        return None
    width = token.shape[-1]
    depth = 1 + max((int(m.group(1)) for k in state if (m := re.match(r"blocks\.(\d+)\.", k))), default=-1)
    convs = {int(m.group(1)) for k in state if (m := re.match(r"patch_embed\.proj\.(\d+)\.0\.weight", k))}
    patch = {4: 16, 3: 8}.get(len(convs))
    temperature = state.get("blocks.0.attn.temperature")
    heads = temperature.shape[0] if temperature is not None else None
    candidates = [
        s for s, spec in SIZES.items() if spec.embed_dim == width and heads in (None, spec.num_heads)
    ]
    if patch is None or depth < 1 or not candidates:
        return None
    exact = [s for s in candidates if SIZES[s].depth == depth]
    size = exact[0] if exact else min(candidates, key=lambda c: abs(SIZES[c].depth - depth))
    return f"xcit_{size}_p{patch}", ({} if exact else {"depth": depth})
