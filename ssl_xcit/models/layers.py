"""The building blocks of XCiT (El-Nouby et al., 2021) and CaiT's class attention (Touvron et al., 2021).

Module and parameter names follow timm's ``xcit`` so that its state dicts load with ``strict=True``. timm's
modules are used where ours would only duplicate them: the convolutional patch embedding (timm's
``ConvPatchEmbed``), ``Mlp`` and ``DropPath``. Ours remain where ``benchmarks/bench_xcit.py`` measures them faster
than timm's (docs/benchmarks.md), or where the backbone interface needs something timm's lacks:

* :class:`PositionalEncodingFourier` computes the encoding once per grid and broadcasts it over the batch
  (timm's builds and projects it per image);
* :class:`ClassAttention` / :class:`ClassAttentionBlock` can return the attention weights, which
  ``get_attention_maps`` needs and timm's fused class attention does not expose.

Two departures from timm's arithmetic (not from its results), for speed and memory on long token sequences:

* :class:`XCA` never materialises L2-normalised copies of q and k. It forms the raw d x d Gram matrix and divides by
  the outer product of the per-channel token norms. When there are more tokens than channels it also folds the
  block-diagonal attention into the output projection, so the N x C tensor ``attn @ v`` and its permuted copy
  are never built. Under float16 (``16-mixed``) it normalises q and k first, as timm does, because the raw Gram
  matrix and its gradient leave float16's range.
* :class:`LPI` runs its depthwise convolutions on a channels-last view of the token tensor, so the (B, N, C) <->
  (B, C, H, W) round trip costs no copy.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from timm.layers import DropPath, Mlp
from timm.models.xcit import ConvPatchEmbed as TimmConvPatchEmbed
from torch import Tensor, nn

from ssl_xcit.errors import UserError


class PositionalEncodingFourier(nn.Module):
    """2-D sinusoidal encoding: 16 frequencies x (sin, cos) per axis -> 64 dims, projected to ``dim``.

    The encoding is computed for every input grid, so any resolution works without interpolation. It does not
    depend on the batch, so it is built once per call and broadcast over the batch.
    """

    def __init__(self, hidden_dim: int = 32, dim: int = 768, temperature: float = 10000.0) -> None:
        super().__init__()
        self.token_projection = nn.Conv2d(hidden_dim * 2, dim, kernel_size=1)
        self.scale = 2 * math.pi
        self.temperature = temperature
        self.hidden_dim = hidden_dim
        self.dim = dim
        self.eps = 1e-6

    def fourier_features(self, height: int, width: int, device: torch.device) -> Tensor:
        """(H*W, 2*hidden_dim) features: y encoding then x encoding, sin/cos interleaved, in float32."""
        y = torch.arange(1, height + 1, dtype=torch.float32, device=device)
        x = torch.arange(1, width + 1, dtype=torch.float32, device=device)
        y = y / (y[-1] + self.eps) * self.scale
        x = x / (x[-1] + self.eps) * self.scale
        channel = torch.arange(self.hidden_dim, dtype=torch.float32, device=device)
        freq = self.temperature ** (2 * torch.div(channel, 2, rounding_mode="floor") / self.hidden_dim)

        def encode(coord: Tensor) -> Tensor:
            angles = coord[:, None] / freq  # (L, hidden)
            return torch.stack((angles[:, 0::2].sin(), angles[:, 1::2].cos()), dim=2).flatten(1)

        pos_y = encode(y)[:, None, :].expand(height, width, self.hidden_dim)
        pos_x = encode(x)[None, :, :].expand(height, width, self.hidden_dim)
        return torch.cat((pos_y, pos_x), dim=2).reshape(height * width, 2 * self.hidden_dim)

    def forward(self, height: int, width: int) -> Tensor:
        """Return the (1, H*W, dim) encoding in the projection's dtype."""
        weight = self.token_projection.weight
        feats = self.fourier_features(height, width, weight.device).to(weight.dtype)
        # A 1x1 convolution over the grid is a linear map over the channel axis.
        pos = F.linear(feats, weight.flatten(1), self.token_projection.bias)
        return pos.unsqueeze(0)


def conv_patch_embed(patch_size: int = 16, in_chans: int = 3, embed_dim: int = 768) -> nn.Module:
    """timm's XCiT convolutional patch embedding (stride-2 3x3 conv + BN, x4 for patch 16, x3 for patch 8).

    timm's module is used as is; only the patch-size check is ours, because timm raises a bare TypeError for
    other sizes.
    """
    if patch_size not in (8, 16):
        raise UserError(
            f"XCiT's convolutional patch embedding supports patch sizes 8 and 16, got {patch_size}"
        )
    return TimmConvPatchEmbed(patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim)


class LPI(nn.Module):
    """Local patch interaction: depthwise 3x3 conv -> GELU -> BatchNorm -> depthwise 3x3 conv."""

    def __init__(self, in_features: int, kernel_size: int = 3) -> None:
        super().__init__()
        padding = kernel_size // 2
        self.conv1 = nn.Conv2d(in_features, in_features, kernel_size, padding=padding, groups=in_features)
        self.act = nn.GELU()
        self.bn = nn.BatchNorm2d(in_features)
        self.conv2 = nn.Conv2d(in_features, in_features, kernel_size, padding=padding, groups=in_features)

    def forward(self, x: Tensor, height: int, width: int) -> Tensor:
        batch, tokens, channels = x.shape
        # (B, N, C) viewed as (B, H, W, C) and permuted is a channels-last NCHW tensor: no copy.
        x = x.reshape(batch, height, width, channels).permute(0, 3, 1, 2)
        x = self.conv2(self.bn(self.act(self.conv1(x))))
        return x.permute(0, 2, 3, 1).reshape(batch, tokens, channels)


# torch.export (and only it) must take XCA's plain product (``XCA.forward``). ``torch.compiler.is_exporting`` is
# torch 2.7's; on 2.6, torch.compile takes the plain product too (the same values, without the fused speed-up).
_is_exporting = getattr(torch.compiler, "is_exporting", torch.compiler.is_compiling)


def _float16_compute(x: Tensor) -> bool:
    """Whether XCA's products run in float16: a float16 input, or float16 autocast on its device.

    The meta device (ssl-xcit models' shape pass) has no autocast, and asking it raises. It is named here
    rather than asked ``torch.amp.is_autocast_available``: dynamo before torch 2.12 cannot trace that call and
    broke a compiled backbone's graph at every XCA block (``tests/models/test_xcit_compile.py``); the two
    queries below it folds to constants, guarded, on every torch from 2.6."""
    if x.dtype == torch.float16:
        return True
    device = x.device.type
    if device == "meta":
        return False
    return torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.float16


def _norm32(t: Tensor, dim: int) -> Tensor:
    """L2 norm over ``dim`` accumulated and returned in float32, kept as a size-1 axis for broadcasting."""
    return torch.linalg.vector_norm(t, dim=dim, keepdim=True, dtype=torch.float32)


class XCA(nn.Module):
    """Cross-covariance attention: a d x d softmax attention over channels within each head.

    q and k are L2-normalised along the token axis, so each attention logit is a cosine similarity between two
    channels, scaled by a learnable per-head temperature. Cost and memory are linear in the number of tokens.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise UserError(f"embed dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.temperature = nn.Parameter(torch.ones(num_heads, 1, 1))
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def attention(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Return the (B, h, d, d) attention after softmax and v as (B, N, h, d)."""
        batch, tokens, channels = x.shape
        head_dim = channels // self.num_heads
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, head_dim)
        q, k, v = qkv.unbind(2)  # each (B, N, h, d), strided views
        q = q.permute(0, 2, 3, 1)  # (B, h, d, N)
        k = k.permute(0, 2, 1, 3)  # (B, h, N, d)
        if _float16_compute(x):
            # The raw Gram entry q_i.k_j spans |q_i| |k_j|: float16's range (6e-5 to 65504) cannot hold it, nor
            # the 1 / (|q_i| |k_j|) in its gradient (0 / 0 in the forward for small tokens, inf - inf in the
            # backward at one token). Normalised first, as timm does, the product holds cosines in [-1, 1];
            # the norms and divisions are float32 (CPU autocast would otherwise run them in float16, where
            # F.normalize's eps of 1e-12 is 0). docs/backbones.md.
            q_unit = q / _norm32(q, -1).clamp_min(1e-12)
            k_unit = k / _norm32(k, -2).clamp_min(1e-12)
            logits = (q_unit.to(q.dtype) @ k_unit.to(k.dtype)) * self.temperature
        else:
            gram = q @ k  # (B, h, d, d) raw channel cross-covariance
            # cos(q_i, k_j) = q_i.k_j / (|q_i| |k_j|), with F.normalize's eps on each norm.
            q_norm = torch.linalg.vector_norm(q, dim=-1).clamp_min(1e-12)  # (B, h, d)
            k_norm = torch.linalg.vector_norm(k, dim=-2).clamp_min(1e-12)  # (B, h, d)
            logits = gram / (q_norm.unsqueeze(-1) * k_norm.unsqueeze(-2)) * self.temperature
        return self.attn_drop(logits.softmax(dim=-1)), v

    def forward(self, x: Tensor) -> Tensor:
        batch, tokens, channels = x.shape
        attn, v = self.attention(x)
        head_dim = channels // self.num_heads
        # A traced program must hold for every resolution, so torch.export takes the plain product, which is
        # right for any N (a branch on N would become a guard that refuses the other sizes).
        if not _is_exporting() and tokens > channels:
            # out[n, h*d + i] = sum_j attn[h, i, j] v[n, h*d + j], then proj. Both steps are linear in v, so one
            # (C x C) matrix per image does both: it costs C*C*d instead of N*C*d multiply-adds and skips the
            # N x C intermediate and its permuted copy, which pays off once N > C (high resolutions).
            proj_w = self.proj.weight.reshape(channels, self.num_heads, head_dim)  # (C_out, h, d_i)
            fused = torch.einsum("ohi,bhij->bhjo", proj_w, attn).reshape(batch, channels, channels)
            out = torch.baddbmm(
                self.proj.bias.expand(batch, 1, channels), v.reshape(batch, tokens, channels), fused
            )
        else:
            out = v.permute(0, 2, 1, 3) @ attn.transpose(-2, -1)  # (B, h, N, d)
            out = self.proj(out.transpose(1, 2).reshape(batch, tokens, channels))
        return self.proj_drop(out)


class ClassAttention(nn.Module):
    """CaiT class attention: only the CLS token queries; keys and values come from every token."""

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.k = nn.Linear(dim, dim, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor, return_attention: bool = False) -> tuple[Tensor, Tensor | None]:
        """Return the new CLS token (B, 1, C) and, if asked, the (B, h, N+1) attention of CLS over all tokens."""
        batch, tokens, channels = x.shape
        q = self.q(x[:, 0]).reshape(batch, self.num_heads, 1, self.head_dim)
        k = self.k(x).reshape(batch, tokens, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).reshape(batch, tokens, self.num_heads, self.head_dim).transpose(1, 2)
        attn = None
        if return_attention or (self.training and self.attn_drop.p > 0):
            attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)  # (B, h, 1, N)
            cls = self.attn_drop(attn) @ v
            attn = attn.squeeze(2)
        else:
            cls = F.scaled_dot_product_attention(q, k, v)
        cls = self.proj(cls.transpose(1, 2).reshape(batch, 1, channels))
        return self.proj_drop(cls), attn


class XCABlock(nn.Module):
    """x + g1*XCA(LN(x)); x + g3*LPI(LN(x)); x + g2*MLP(LN(x)), each branch with LayerScale and drop path.

    The gammas are numbered 1, 3, 2 in execution order for weight compatibility with the official code.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        eta: float = 1.0,
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = XCA(dim, num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm3 = nn.LayerNorm(dim, eps=1e-6)
        self.local_mp = LPI(in_features=dim)
        self.drop_path3 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio), drop=proj_drop)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.gamma1 = nn.Parameter(eta * torch.ones(dim))
        self.gamma3 = nn.Parameter(eta * torch.ones(dim))
        self.gamma2 = nn.Parameter(eta * torch.ones(dim))

    def forward(self, x: Tensor, height: int, width: int) -> Tensor:
        x = x + self.drop_path1(self.gamma1 * self.attn(self.norm1(x)))
        x = x + self.drop_path3(self.gamma3 * self.local_mp(self.norm3(x), height, width))
        x = x + self.drop_path2(self.gamma2 * self.mlp(self.norm2(x)))
        return x


class ClassAttentionBlock(nn.Module):
    """CaiT-style class-attention block as XCiT uses it.

    As in the reference implementation, the patch tokens are also updated: they receive ``gamma1 * LN1(x)`` and
    are then doubled by the final residual. This is kept deliberately for weight compatibility (timm PR #747).
    ``tokens_norm`` applies ``norm2`` to every token instead of the CLS token only.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        eta: float = 1.0,
        tokens_norm: bool = False,
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = ClassAttention(
            dim, num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop
        )
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio), drop=proj_drop)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.gamma1 = nn.Parameter(eta * torch.ones(dim))
        self.gamma2 = nn.Parameter(eta * torch.ones(dim))
        self.tokens_norm = tokens_norm

    def forward(self, x: Tensor, return_attention: bool = False) -> tuple[Tensor, Tensor | None]:
        x_norm1 = self.norm1(x)
        cls, attn = self.attn(x_norm1, return_attention=return_attention)
        x = x + self.drop_path1(self.gamma1 * torch.cat((cls, x_norm1[:, 1:]), dim=1))
        if self.tokens_norm:
            x = self.norm2(x)
        else:
            x = torch.cat((self.norm2(x[:, 0:1]), x[:, 1:]), dim=1)
        cls = self.gamma2 * self.mlp(x[:, 0:1])
        x = x + self.drop_path2(torch.cat((cls, x[:, 1:]), dim=1))
        return x, attn
