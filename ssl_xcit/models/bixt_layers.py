"""BiXT building blocks (official parameter names): latent self-attention, bi-directional and one-sided
cross-attention, their blocks, and the strided conv tokenizer. The model is assembled in
:mod:`ssl_xcit.models.bixt`."""

from __future__ import annotations

from functools import partial

from timm.layers import DropPath, LayerScale, Mlp
from torch import Tensor, nn

Norm = partial(nn.LayerNorm, eps=1e-6)


def _heads(x: Tensor, parts: int, num_heads: int) -> tuple[Tensor, ...]:
    """(B, L, parts * D) -> ``parts`` tensors (B, heads, L, D / heads)."""
    b, n, c = x.shape
    return x.reshape(b, n, parts, num_heads, c // (parts * num_heads)).permute(2, 0, 3, 1, 4).unbind(0)


def _merge(x: Tensor) -> Tensor:
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


class SelfAttention(nn.Module):
    """Multi-head self-attention over the latents."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool, attn_drop: float, proj_drop: float) -> None:
        super().__init__()
        self.num_heads, self.attn_drop_p = num_heads, attn_drop
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = _heads(self.qkv(x), 3, self.num_heads)
        drop = self.attn_drop_p if self.training else 0.0
        out = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=drop)
        return self.proj_drop(self.proj(_merge(out)))


class CrossAttention(nn.Module):
    """Bi-directional cross-attention: one similarity matrix, softmaxed over tokens (latents' update) and over
    latents (tokens' update). ``one_sided`` keeps only the latents' direction (the official last layer)."""

    def __init__(self, dim: int, num_heads: int, rv_bias: bool, attn_drop: float, proj_drop: float,
                 one_sided: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.num_heads, self.one_sided = num_heads, one_sided
        self.scale = (dim // num_heads) ** -0.5
        if one_sided:
            self.r_latents = nn.Linear(dim, dim, bias=rv_bias)
        else:
            self.rv_latents = nn.Linear(dim, dim * 2, bias=rv_bias)
            self.proj_pat = nn.Linear(dim, dim)
        self.rv_patches = nn.Linear(dim, dim * 2, bias=rv_bias)
        self.proj_lat = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, lat: Tensor, pat: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
        """Updates (latents, tokens or None) and the latents-to-tokens attention (B, heads, M, N)."""
        if self.one_sided:
            (r_lat,) = _heads(self.r_latents(lat), 1, self.num_heads)
        else:
            r_lat, v_lat = _heads(self.rv_latents(lat), 2, self.num_heads)
        r_pat, v_pat = _heads(self.rv_patches(pat), 2, self.num_heads)
        sim = (r_lat @ r_pat.transpose(-2, -1)) * self.scale  # latents in batch 1 broadcast to B here
        attn = sim.softmax(dim=-1)
        new_lat = self.proj_drop(self.proj_lat(_merge(self.attn_drop(attn) @ v_pat)))
        if self.one_sided:
            return new_lat, None, attn
        attn_t = self.attn_drop(sim.transpose(-2, -1).softmax(dim=-1))
        return new_lat, self.proj_drop(self.proj_pat(_merge(attn_t @ v_lat))), attn


def _residual(dim: int, init_values: float | None, drop_path: float) -> tuple[nn.Module, nn.Module]:
    ls = LayerScale(dim, init_values) if init_values else nn.Identity()
    return ls, DropPath(drop_path) if drop_path > 0 else nn.Identity()


class SABlock(nn.Module):
    """Pre-norm latent self-attention + MLP."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, qkv_bias: bool, drop: float, attn_drop: float,
                 init_values: float | None, drop_path: float) -> None:  # fmt: skip
        super().__init__()
        self.norm1 = Norm(dim)
        self.attn = SelfAttention(dim, num_heads, qkv_bias, attn_drop, drop)
        self.ls1, self.drop_path1 = _residual(dim, init_values, drop_path)
        self.norm2 = Norm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)
        self.ls2, self.drop_path2 = _residual(dim, init_values, drop_path)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class CABlock(nn.Module):
    """Pre-norm cross-attention block; each stream has its own LNs, LayerScale, DropPath and MLP."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, rv_bias: bool, drop: float, attn_drop: float,
                 init_values: float | None, drop_path: float, one_sided: bool) -> None:  # fmt: skip
        super().__init__()
        self.one_sided = one_sided
        self.norm1_lat, self.norm1_pat = Norm(dim), Norm(dim)
        self.attn = CrossAttention(dim, num_heads, rv_bias, attn_drop, drop, one_sided=one_sided)
        self.ls1_lat, self.drop_path1_lat = _residual(dim, init_values, drop_path)
        self.norm2_lat = Norm(dim)
        self.mlp_lat = Mlp(dim, int(dim * mlp_ratio), drop=drop)
        self.ls2_lat, self.drop_path2_lat = _residual(dim, init_values, drop_path)
        if not one_sided:
            self.ls1_pat, self.drop_path1_pat = _residual(dim, init_values, drop_path)
            self.norm2_pat = Norm(dim)
            self.mlp_pat = Mlp(dim, int(dim * mlp_ratio), drop=drop)
            self.ls2_pat, self.drop_path2_pat = _residual(dim, init_values, drop_path)

    def forward(self, lat: Tensor, pat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        d_lat, d_pat, attn = self.attn(self.norm1_lat(lat), self.norm1_pat(pat))
        lat = lat + self.drop_path1_lat(self.ls1_lat(d_lat))
        lat = lat + self.drop_path2_lat(self.ls2_lat(self.mlp_lat(self.norm2_lat(lat))))
        if d_pat is not None:
            pat = pat + self.drop_path1_pat(self.ls1_pat(d_pat))
            pat = pat + self.drop_path2_pat(self.ls2_pat(self.mlp_pat(self.norm2_pat(pat))))
        return lat, pat, attn


class BiXTBlock(nn.Module):
    """Cross-attention (bi-directional or one-sided) followed by latent self-attention."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, qkv_bias: bool, rv_bias: bool, drop: float,
                 attn_drop: float, init_values: float | None, sa_drop_path: float, ca_drop_path: float,
                 one_sided: bool) -> None:  # fmt: skip
        super().__init__()
        self.self_attention_latents = SABlock(
            dim, num_heads, mlp_ratio, qkv_bias, drop, attn_drop, init_values, sa_drop_path
        )
        self.cross_attention_latents_token = CABlock(
            dim, num_heads, mlp_ratio, rv_bias, drop, attn_drop, init_values, ca_drop_path, one_sided
        )

    def forward(self, lat: Tensor, pat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        lat, pat, attn = self.cross_attention_latents_token(lat, pat)
        return self.self_attention_latents(lat), pat, attn


class PatchEmbed(nn.Module):
    """Conv tokenizer: kernel ``patch_size``, stride ``stride``, padded so the grid is exactly H/stride x W/stride."""

    def __init__(self, patch_size: int, stride: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(
            in_chans, embed_dim, patch_size, stride=stride, padding=(patch_size - stride) // 2
        )

    def forward(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        x = self.proj(x)
        return x.flatten(2).transpose(1, 2), (x.shape[-2], x.shape[-1])
