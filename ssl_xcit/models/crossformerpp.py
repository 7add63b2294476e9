"""CrossFormer++ (Wang et al., TPAMI 2023): cross-scale embeddings, SDA/LDA attention, dynamic position bias (DPB),
progressive group size (PGS) and the amplitude cooling layer (ACL).

Parameter names and shapes follow the official classification code (``cheerss/CrossFormer``, ``models/
crossformer.py``), so its released checkpoints load strictly. Unlike that code, nothing depends on a fixed image
size: grouping, padding masks and the DPB index are computed per forward from the feature-map size (cached per
size), and whether a block falls back to global attention is decided per call, never stored (the official
detection backbone stores it and so breaks after one small input, see backbones.md section 2.7).

Data path: CEL (4 convs, stride 4) -> stage 1 -> CEL -> stage 2 -> CEL -> stage 3 -> CEL -> stage 4 -> LN ->
mean over tokens. Stage 3 tokens (stride 16), normed by the following CEL's input LayerNorm, are the dense
descriptors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from functools import lru_cache

import torch
import torch.nn.functional as F
from timm.layers import DropPath, Mlp, trunc_normal_
from torch import Tensor, nn

from ssl_xcit.models.base import Backbone

# Additive logit for padded keys; finite (as the official code) so a fully padded group gives no NaN.
NEG_INF = -1e6

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


@lru_cache(maxsize=64)
def _relative_offsets(group: int) -> tuple[Tensor, Tensor]:
    """All (dy, dx) offsets of a G x G group as floats ((2G-1)^2, 2), and each query-key pair's row in them."""
    span = torch.arange(1 - group, group)
    offsets = torch.stack(torch.meshgrid(span, span, indexing="ij")).flatten(1).t().float()
    coords = torch.stack(torch.meshgrid(torch.arange(group), torch.arange(group), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (group - 1)
    return offsets, (rel[..., 0] * (2 * group - 1) + rel[..., 1]).flatten()


@lru_cache(maxsize=64)
def _padding_mask(height: int, width: int, group: int, interval: int, lda: bool) -> Tensor | None:
    """Additive key mask (num_groups, 1, G*G) for one image, or None when the map needs no padding."""
    div = group * interval if lda else group
    pad_h, pad_w = -height % div, -width % div
    if not (pad_h or pad_w):
        return None
    valid = torch.zeros(height + pad_h, width + pad_w, dtype=torch.bool)
    valid[:height, :width] = True
    groups = _group(valid[None, :, :, None], group, interval, lda).squeeze(-1)
    return torch.zeros(groups.shape).masked_fill(~groups, NEG_INF)[:, None, :]


def _group(x: Tensor, group: int, interval: int, lda: bool) -> Tensor:
    """(B, Hp, Wp, C) -> (B * groups, G*G, C): local G x G windows (SDA), or G x G tokens taken every
    ``interval`` tokens inside (G*I) x (G*I) regions (LDA)."""
    b, hp, wp, c = x.shape
    if not lda:
        x = x.reshape(b, hp // group, group, wp // group, group, c).permute(0, 1, 3, 2, 4, 5)
    else:
        rh, rw = hp // (group * interval), wp // (group * interval)
        x = x.reshape(b, rh, group, interval, rw, group, interval, c).permute(0, 1, 4, 3, 6, 2, 5, 7)
    return x.reshape(-1, group * group, c)


def _ungroup(x: Tensor, batch: int, hp: int, wp: int, group: int, interval: int, lda: bool) -> Tensor:
    """Inverse of :func:`_group`: (B * groups, G*G, C) -> (B, Hp, Wp, C)."""
    c = x.shape[-1]
    if not lda:
        x = x.reshape(batch, hp // group, wp // group, group, group, c).permute(0, 1, 3, 2, 4, 5)
    else:
        rh, rw = hp // (group * interval), wp // (group * interval)
        x = x.reshape(batch, rh, rw, interval, interval, group, group, c).permute(0, 1, 5, 3, 2, 6, 4, 7)
    return x.reshape(batch, hp, wp, c)


class DynamicPosBias(nn.Module):
    """DPB: an MLP from a relative offset (dy, dx) to one bias per head, so any group size works."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.pos_dim = dim // 4
        self.pos_proj = nn.Linear(2, self.pos_dim)
        self.pos1 = nn.Sequential(
            nn.LayerNorm(self.pos_dim), nn.ReLU(), nn.Linear(self.pos_dim, self.pos_dim)
        )
        self.pos2 = nn.Sequential(
            nn.LayerNorm(self.pos_dim), nn.ReLU(), nn.Linear(self.pos_dim, self.pos_dim)
        )
        self.pos3 = nn.Sequential(nn.LayerNorm(self.pos_dim), nn.ReLU(), nn.Linear(self.pos_dim, num_heads))

    def forward(self, group: int) -> Tensor:
        """Bias (heads, G*G, G*G) for a G x G group."""
        offsets, index = _relative_offsets(group)
        device = self.pos_proj.weight.device
        table = self.pos3(self.pos2(self.pos1(self.pos_proj(offsets.to(device, self.pos_proj.weight.dtype)))))
        n = group * group
        return table[index.to(device)].view(n, n, -1).permute(2, 0, 1)


class Attention(nn.Module):
    """Multi-head self-attention inside groups, with DPB and an optional padding mask."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0) -> None:  # fmt: skip
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.pos = DynamicPosBias(dim // 4, num_heads)  # pos_dim = dim // 16, as the official code
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor, group: int, batch: int, mask: Tensor | None) -> Tensor:
        """x: (B * groups, G*G, C); mask: (groups, 1, G*G) additive, shared by every image."""
        bg, n, c = x.shape
        qkv = self.qkv(x).reshape(batch, bg // batch, n, 3, self.num_heads, c // self.num_heads)
        q, k, v = qkv.permute(3, 0, 1, 4, 2, 5).unbind(0)  # (B, groups, heads, N, head_dim)
        attn = (q * self.scale) @ k.transpose(-2, -1) + self.pos(group).to(q.dtype)
        if mask is not None:  # in float32: -1e6 would become -inf in fp16 and NaN for fully padded groups
            attn = (attn.float() + mask.to(attn.device)[:, None]).softmax(dim=-1).to(v.dtype)
        else:
            attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = (attn @ v).transpose(2, 3).reshape(bg, n, c)
        return self.proj_drop(self.proj(x))


class CrossFormerBlock(nn.Module):
    """Pre-norm block: SDA or LDA attention, MLP, and (for ACL blocks) a depth-wise conv + LN without residual."""

    def __init__(self, dim: int, num_heads: int, group_size: int, interval: int, lda: bool, mlp_ratio: float,
                 qkv_bias: bool, drop: float, attn_drop: float, drop_path: float, use_acl: bool) -> None:  # fmt: skip
        super().__init__()
        self.group_size, self.interval, self.lda = group_size, interval, lda
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads, qkv_bias, attn_drop, drop)
        self.use_acl = use_acl
        if use_acl:
            self.ex_conv = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
            self.ex_ln = nn.LayerNorm(dim)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)

    def layout(self, height: int, width: int) -> tuple[int, bool]:
        """(G, LDA?) at this map size: a map no larger than G gets one global SDA group (official rule)."""
        if min(height, width) <= self.group_size:
            return min(height, width), False
        return self.group_size, self.lda

    def forward(self, x: Tensor, height: int, width: int) -> Tensor:
        b, _, c = x.shape
        group, lda = self.layout(height, width)
        div = group * self.interval if lda else group
        y = F.pad(self.norm1(x).view(b, height, width, c), (0, 0, 0, -width % div, 0, -height % div))
        hp, wp = y.shape[1:3]
        mask = _padding_mask(height, width, group, self.interval, lda)
        y = self.attn(_group(y, group, self.interval, lda), group, b, mask)
        y = _ungroup(y, b, hp, wp, group, self.interval, lda)[:, :height, :width].reshape(b, -1, c)
        x = x + self.drop_path(y)
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        if self.use_acl:
            x = self.ex_conv(x.transpose(1, 2).reshape(b, c, height, width))
            x = self.ex_ln(x.flatten(2).transpose(1, 2))
        return x


def _split_dims(total: int, kernels: Sequence[int]) -> list[int]:
    """Channel split of a cross-scale embedding: halve per larger kernel, the last two share (official rule)."""
    return [total // 2 ** (i + 1) if i < len(kernels) - 1 else total // 2**i for i in range(len(kernels))]


class PatchEmbed(nn.Module):
    """Stage-1 CEL: convs of several kernel sizes, stride 4, centred by padding, concatenated, then LN."""

    def __init__(self, patch_size: Sequence[int], in_chans: int, embed_dim: int) -> None:
        super().__init__()
        stride = patch_size[0]
        self.projs = nn.ModuleList(
            nn.Conv2d(in_chans, d, kernel_size=k, stride=stride, padding=(k - stride) // 2)
            for k, d in zip(patch_size, _split_dims(embed_dim, patch_size), strict=True)
        )
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        maps = [proj(x) for proj in self.projs]
        grid = tuple(maps[0].shape[-2:])
        return self.norm(torch.cat(maps, dim=1).flatten(2).transpose(1, 2)), grid


class PatchMerging(nn.Module):
    """Stage-2/3/4 CEL: LN, then stride-2 convs of several kernel sizes, concatenated to twice the width."""

    def __init__(self, dim: int, patch_size: Sequence[int]) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.reductions = nn.ModuleList(
            nn.Conv2d(dim, d, kernel_size=k, stride=2, padding=(k - 2) // 2)
            for k, d in zip(patch_size, _split_dims(2 * dim, patch_size), strict=True)
        )

    def forward(self, x: Tensor, height: int, width: int) -> tuple[Tensor, tuple[int, int]]:
        b, _, c = x.shape
        x = self.norm(x).transpose(1, 2).reshape(b, c, height, width)
        maps = [conv(x) for conv in self.reductions]
        return torch.cat(maps, dim=1).flatten(2).transpose(1, 2), (height // 2, width // 2)


class Stage(nn.Module):
    """Blocks of one stage (SDA at even, LDA at odd indices; ACL after every third but the last) + next CEL."""

    def __init__(self, dim: int, depth: int, num_heads: int, group_size: int, interval: int,
                 merge: Sequence[int] | None, use_acl: bool, drop_path: Sequence[float], **block_kw) -> None:  # fmt: skip
        super().__init__()
        self.blocks = nn.ModuleList(
            CrossFormerBlock(
                dim,
                num_heads,
                group_size,
                interval,
                lda=i % 2 == 1,
                drop_path=drop_path[i],
                use_acl=use_acl and (i + 1) % 3 == 0 and i < depth - 1,
                **block_kw,
            )  # fmt: skip
            for i in range(depth)
        )
        self.downsample = PatchMerging(dim, merge) if merge is not None else None


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
    size_multiple = 32  # four stages: stride 4, then three stride-2 merges

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
            )  # fmt: skip
            for i in range(n_stages)
        )
        self.norm = nn.LayerNorm(self.num_features)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self._register_load_state_dict_pre_hook(_drop_size_bound_buffers)
        self.apply(_init_weights)

    def check_input(self, x: Tensor) -> None:
        """ValueError naming the size when a side is not a multiple of 32 (the total stride of the 4 stages)."""
        try:
            super().check_input(x)
        except ValueError as err:
            if x.ndim != 4:
                raise
            raise ValueError(f"{err}; CrossFormer++ embeds at stride 4 and halves the map 3 times") from None

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

    def forward_patch_tokens(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """Stage-3 tokens (B, H/16 * W/16, 4C), normed by the stage-4 CEL's input LN, and their grid."""
        last = sum(self.depths[:3]) - 1
        for index, stage, tokens, grid in self._blocks(x, stop=last):
            if index == last:
                return self._stage_norm(stage)(tokens), grid
        raise AssertionError("unreachable: stage 3 always runs")

    # -------------------------------------------------------- evaluation access
    def _block_indices(self, n: int | Sequence[int]) -> list[int]:
        total = sum(self.depths)
        indices = list(range(total - n, total)) if isinstance(n, int) else [int(i) for i in n]
        bad = [i for i in indices if not -total <= i < total]
        if bad or not indices:
            raise ValueError(
                f"block indices {bad or indices} are out of range for {self.name} with {total} blocks "
                f"(stages of {list(self.depths)} blocks, indexed globally)"
            )
        return sorted(i % total for i in indices)

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


def _init_weights(module: nn.Module) -> None:
    """Official init: Linear trunc-normal(0.02) with zero bias; LN (1, 0); convs keep PyTorch's default."""
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


_SIZE_BOUND = (".attn.biases", ".attn.relative_position_index", ".attn_mask")


def _drop_size_bound_buffers(state_dict: dict, prefix: str, *args) -> None:
    """Checkpoints of the v1 code store DPB offsets, index and masks built for one image size (backbones.md 5.7);
    they are recomputed per input here, so they are dropped rather than reported as unexpected keys."""
    for key in [k for k in state_dict if k.startswith(prefix) and k.endswith(_SIZE_BOUND)]:
        del state_dict[key]


def create(name: str, **overrides) -> CrossFormerPP:
    """Build a named variant; ``overrides`` replace constructor arguments (e.g. ``drop_path_rate``)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown CrossFormer++ variant {name!r}; known: {', '.join(VARIANTS)}")
    return CrossFormerPP(**{**VARIANTS[name], **overrides, "name": name})
