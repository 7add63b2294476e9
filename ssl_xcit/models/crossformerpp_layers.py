"""CrossFormer++ building blocks (official parameter names): per-size grouping and padding masks, dynamic
position bias, group attention, the block with its optional amplitude cooling layer, and the cross-scale
embedding layers. The model is assembled in :mod:`ssl_xcit.models.crossformerpp`."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import DropPath, Mlp
from torch import Tensor, nn

# Additive logit for padded keys; finite (as the official code) so a fully padded group gives no NaN.
NEG_INF = -1e6


def _cached(function: Any, *args: Any) -> Any:
    """``function(*args)`` from its cache, except while torch.export or torch.compile traces: the tensors made
    then are fake, and a cached fake tensor would break every later eager call."""
    return function.__wrapped__(*args) if torch.compiler.is_compiling() else function(*args)


@lru_cache(maxsize=64)
def _relative_offsets(group: int) -> tuple[Tensor, Tensor]:
    """All (dy, dx) offsets of a G x G group as floats ((2G-1)^2, 2), and each query-key pair's row in them."""
    # Cached tensors outlive the call: made under inference mode (k-NN, predict) they could never be saved
    # for a later backward pass, so they are always made as normal tensors.
    with torch.inference_mode(False):
        span = torch.arange(1 - group, group)
        offsets = torch.stack(torch.meshgrid(span, span, indexing="ij")).flatten(1).t().float()
        coords = torch.stack(torch.meshgrid(torch.arange(group), torch.arange(group), indexing="ij")).flatten(
            1
        )
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (group - 1)
        return offsets, (rel[..., 0] * (2 * group - 1) + rel[..., 1]).flatten()


@lru_cache(maxsize=64)
def _padding_mask(height: int, width: int, group: int, interval: int, lda: bool) -> Tensor | None:
    """Additive key mask (num_groups, 1, G*G) for one image, or None when the map needs no padding."""
    div = group * interval if lda else group
    pad_h, pad_w = -height % div, -width % div
    if not (pad_h or pad_w):
        return None
    with torch.inference_mode(False):  # cached: see _relative_offsets
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
        offsets, index = _cached(_relative_offsets, group)
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
        mask = _cached(_padding_mask, height, width, group, self.interval, lda)
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
                 merge: Sequence[int] | None, use_acl: bool, drop_path: Sequence[float],
                 block_class: type[CrossFormerBlock] | None = None, **block_kw) -> None:  # fmt: skip
        super().__init__()
        block_class = block_class or CrossFormerBlock  # the model's passes its list-taking subclass
        self.blocks = nn.ModuleList(
            block_class(
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
