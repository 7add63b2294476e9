"""CrossFormer++ (Wang et al., TPAMI 2023): cross-scale embeddings, SDA/LDA attention, dynamic position bias (DPB),
progressive group size (PGS) and the amplitude cooling layer (ACL).

Parameter names and shapes follow the official classification code (``cheerss/CrossFormer``, ``models/
crossformer.py``), so its released checkpoints load strictly (v1 checkpoints' size-bound buffers are dropped by
:func:`convert_state_dict`). Unlike that code, nothing depends on a fixed image
size: grouping, padding masks and the DPB index are computed per forward from the feature-map size (cached per
size), and whether a block falls back to global attention is decided per call, never stored (the official
detection backbone stores it and so breaks after one small input, see backbones.md section 2.7).

Data path: CEL (4 convs, stride 4) -> stage 1 -> CEL -> stage 2 -> CEL -> stage 3 -> CEL -> stage 4 -> LN ->
mean over tokens. Stage 3 tokens (stride 16), normed by the following CEL's input LayerNorm, are the dense
descriptors. The blocks take lists of inputs with the lists of their grid sides (``forward_cls_patches_list``:
each block called once for all of them, :class:`~ssl_xcit.models.base.ListForward`); the CELs run per input.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Mapping, Sequence

import torch
from timm.layers import trunc_normal_
from torch import Tensor, nn

from ssl_xcit.errors import UserError
from ssl_xcit.models import crossformerpp_layers
from ssl_xcit.models.base import Backbone, ListForward, per_input
from ssl_xcit.models.crossformerpp_layers import PatchEmbed, Stage

_COMMON = dict(
    patch_size=(4, 8, 16, 32),
    merge_size=((2, 4), (2, 4), (2, 4)),
    group_size=(4, 4, 14, 7),  # PGS, configs/crossformer_pp/*.yaml (GROUP_TYPE constant)
    interval=(4, 2, 1, 1),  # LDA interval of the code; the paper's Table 1 prints 4,4,1,1 (backbones.md 5)
    mlp_ratio=4.0,
    use_acl=True,
)
VARIANTS: dict[str, dict] = {
    "crossformerpp_small": dict(_COMMON, embed_dim=64, depths=(2, 2, 18, 2), num_heads=(2, 4, 8, 16)),
    "crossformerpp_base": dict(_COMMON, embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24)),
    "crossformerpp_large": dict(_COMMON, embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)),
    "crossformerpp_huge": dict(_COMMON, embed_dim=128, depths=(6, 6, 18, 2), num_heads=(4, 8, 16, 32)),
}
# Stochastic depth of the supervised ImageNet configs (DROP_PATH_RATE in the official yaml files).
SUPERVISED_DROP_PATH = {
    "crossformerpp_small": 0.2,
    "crossformerpp_base": 0.3,
    "crossformerpp_large": 0.5,
    "crossformerpp_huge": 0.5,
}


class CrossFormerBlock(ListForward, crossformerpp_layers.CrossFormerBlock):
    """:class:`ssl_xcit.models.crossformerpp_layers.CrossFormerBlock` whose ``forward`` also takes a list of token
    tensors, with lists of their grid sides (``forward_cls_patches_list``); same name and parameters."""


class CrossFormerPP(Backbone):
    """CrossFormer++ with official parameter names, any input whose sides are multiples of 32.

    Args:
        embed_dim, depths, num_heads: stage-1 width, blocks per stage, heads per stage (head dim 32).
        group_size, interval: per-stage group size G (PGS) and LDA interval I.
        patch_size, merge_size: kernel sizes of the stage-1 CEL and of the three merging CELs.
        num_classes: linear head on the pooled embedding; 0 (self-supervised default) returns the embedding.
        drop_path_rate: stochastic depth, linear from 0 over all blocks (official rule).
        use_acl: amplitude cooling layers after every third block of a stage (never its last).
        name: registry name, for error messages and checkpoint metadata.
    """

    family = "crossformerpp"
    takes_input_lists = True
    size_multiple = 32  # four stages: stride 4, then three stride-2 merges
    size_reason = "CrossFormer++ embeds at stride 4 and halves the map 3 times"
    masking_refusal = (
        "its cross-scale embedding reads 4- to 32-px windows around each stride-4 patch and its stages merge "
        "tokens, so no output token belongs to one maskable patch"
    )

    def __init__(
        self,
        embed_dim: int = 64,
        depths: Sequence[int] = (2, 2, 18, 2),
        num_heads: Sequence[int] = (2, 4, 8, 16),
        group_size: Sequence[int] = (4, 4, 14, 7),
        interval: Sequence[int] = (4, 2, 1, 1),
        patch_size: Sequence[int] = (4, 8, 16, 32),
        merge_size: Sequence[Sequence[int]] = ((2, 4), (2, 4), (2, 4)),
        in_chans: int = 3,
        num_classes: int = 0,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        use_acl: bool = True,
        name: str = "crossformerpp",
    ) -> None:
        super().__init__()
        self.name = name
        self.num_classes = num_classes
        self.depths = tuple(depths)
        n_stages = len(depths)
        self.stage_dims = [embed_dim * 2**i for i in range(n_stages)]
        self.num_features = self.embed_dim = self.stage_dims[-1]
        self.dense_dim = self.stage_dims[2]
        self.size_multiple = patch_size[0] * 2 ** (n_stages - 1)
        self.grad_checkpointing = False

        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        self.pos_drop = nn.Dropout(drop_rate)
        total = sum(depths)
        dpr = [drop_path_rate * i / max(total - 1, 1) for i in range(total)]  # = torch.linspace, meta-safe
        starts = [sum(depths[:i]) for i in range(n_stages)]
        self.layers = nn.ModuleList(
            Stage(
                self.stage_dims[i],
                depths[i],
                num_heads[i],
                group_size[i],
                interval[i],
                merge=merge_size[i] if i < n_stages - 1 else None,
                use_acl=use_acl,
                drop_path=dpr[starts[i] : starts[i] + depths[i]],
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                drop=drop_rate,
                attn_drop=attn_drop_rate,
                block_class=CrossFormerBlock,
            )  # fmt: skip
            for i in range(n_stages)
        )
        self.norm = nn.LayerNorm(self.num_features)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self._register_load_state_dict_pre_hook(_drop_size_bound_buffers)
        self.apply(_init_weights)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute block activations in the backward pass: less memory for high resolutions."""
        self.grad_checkpointing = enable

    def no_weight_decay_keywords(self) -> set[str]:
        return {"pos"}  # DPB MLPs play the role of a relative-position table

    # ------------------------------------------------------------------ forward
    def _blocks(self, x: Tensor, stop: int | None = None):
        """Yield (global block index, stage, tokens after the block, grid), running stage merges in between."""
        self.check_input(x)
        x, (h, w) = self.patch_embed(x)
        x = self.pos_drop(x)
        index = 0
        for s, stage in enumerate(self.layers):
            if s > 0:
                x, (h, w) = self.layers[s - 1].downsample(x, h, w)
            for block in stage.blocks:
                if self.grad_checkpointing and torch.is_grad_enabled():
                    x = torch.utils.checkpoint.checkpoint(block, x, h, w, use_reentrant=False)
                else:
                    x = block(x, h, w)
                yield index, s, x, (h, w)
                index += 1
                if stop is not None and index > stop:
                    return

    def _stage_norm(self, stage: int) -> nn.LayerNorm:
        """LN applied to a stage's tokens: the next CEL's input LN, or the final LN after stage 4."""
        return self.layers[stage].downsample.norm if stage < len(self.layers) - 1 else self.norm

    def forward_features(self, x: Tensor) -> Tensor:
        """Stage-4 tokens after the final LN, (B, H/32 * W/32, 8C)."""
        return self.norm(deque(self._blocks(x), maxlen=1)[0][2])

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = x.mean(dim=1)
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        """Mean of the normed stage-4 tokens (B, 8C) when ``num_classes == 0``, logits otherwise."""
        return self.forward_head(self.forward_features(x))

    def forward_cls_patches_list(
        self, xs: list[Tensor], masks: list[Tensor | None] | None = None
    ) -> list[tuple[Tensor, Tensor]]:
        """Per input, the global embedding (``forward`` of a headless model) and the final-norm stage-4 tokens
        (``forward_features``), each block called once with the list of all inputs' tokens and the lists of
        their grid sides; the CELs run per input. No masks (``masks`` all None)."""
        if masks is not None and any(m is not None for m in masks):
            self.enable_masking()  # refuses in one line
        for x in xs:
            self.check_input(x)
        embedded = per_input(self.patch_embed, list(xs))
        tokens = [self.pos_drop(t) for t, _ in embedded]
        heights, widths = [h for _, (h, _) in embedded], [w for _, (_, w) in embedded]
        for s, stage in enumerate(self.layers):
            if s > 0:
                merged = per_input(self.layers[s - 1].downsample, tokens, heights, widths)
                tokens = [t for t, _ in merged]
                heights, widths = [h for _, (h, _) in merged], [w for _, (_, w) in merged]
            for block in stage.blocks:
                if self.grad_checkpointing and torch.is_grad_enabled():
                    tokens = torch.utils.checkpoint.checkpoint(
                        block, tokens, heights, widths, use_reentrant=False
                    )
                else:
                    tokens = block(tokens, heights, widths)
        tokens = [self.norm(t) for t in tokens]
        return [(self.forward_head(t, pre_logits=True), t) for t in tokens]

    def forward_patch_tokens(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """Stage-3 tokens (B, H/16 * W/16, 4C), normed by the stage-4 CEL's input LN, and their grid."""
        last = sum(self.depths[:3]) - 1
        for index, stage, tokens, grid in self._blocks(x, stop=last):
            if index == last:
                return self._stage_norm(stage)(tokens), grid
        raise AssertionError("unreachable: stage 3 always runs")

    # -------------------------------------------------------- evaluation access
    def _block_indices(self, n: int | Sequence[int]) -> list[int]:
        detail = f" (stages of {list(self.depths)} blocks, indexed globally)"
        return super()._block_indices(n, sum(self.depths), detail)

    def _intermediates(self, x: Tensor, n: int | Sequence[int]) -> list[tuple[int, Tensor]]:
        wanted = self._block_indices(n)
        return [(s, t) for i, s, t, _ in self._blocks(x, stop=wanted[-1]) if i in wanted]

    def get_intermediate_layers(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """Tokens (B, N_s, C_s) after chosen blocks, indexed over all stages' blocks (0 .. sum(depths) - 1);
        width and token count are those of the block's stage."""
        return [tokens for _, tokens in self._intermediates(x, n)]

    def get_intermediate_cls(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """Per chosen block, the mean of its tokens after the LN that follows its stage, (B, C_s); for the last
        block this equals ``forward`` of a headless model."""
        return [self._stage_norm(s)(t).mean(dim=1) for s, t in self._intermediates(x, n)]

    def get_dense_layers(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """Tokens (B, N_s, C_s) of the chosen blocks after the LN that follows their stage (the next CEL's
        input LN, or the final LN after stage 4): the last block gives ``forward_features``, stage 4 at stride
        32."""
        return [self._stage_norm(s)(t) for s, t in self._intermediates(x, n)]


def _init_weights(module: nn.Module) -> None:
    """Official init: Linear trunc-normal(0.02) with zero bias; LN (1, 0); convs keep PyTorch's default."""
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


# Checkpoints of the v1 code store the DPB offsets and index built for one image size as persistent buffers
# (backbones.md 5.7), beside which the official code registers its padding mask ``attn_mask``. All three are
# recomputed per input here, so they are dropped rather than reported as unexpected keys.
_SIZE_BOUND = re.compile(r"layers\.\d+\.blocks\.\d+\.(attn\.biases|attn\.relative_position_index|attn_mask)")


def _drop_size_bound_buffers(state_dict: dict, prefix: str, *args) -> None:
    for key in [k for k in state_dict if k.startswith(prefix) and _SIZE_BOUND.fullmatch(k[len(prefix) :])]:
        del state_dict[key]


def convert_state_dict(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An official CrossFormer/CrossFormer++ state dict in our layout: the same names without the size-bound
    buffers of v1 checkpoints (``attn.biases``, ``attn.relative_position_index``, ``attn_mask``)."""
    return {k: v for k, v in state_dict.items() if not _SIZE_BOUND.fullmatch(k)}


def create(name: str, **overrides) -> CrossFormerPP:
    """Build a named variant; ``overrides`` replace constructor arguments (e.g. ``drop_path_rate``)."""
    if name not in VARIANTS:
        raise UserError(f"unknown CrossFormer++ variant {name!r}; known: {', '.join(VARIANTS)}")
    return CrossFormerPP(**{**VARIANTS[name], **overrides, "name": name})
