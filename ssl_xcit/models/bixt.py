"""BiXT: bi-directional cross-attention transformer (Hiller et al., NeurIPS 2024).

M learned latents and N patch tokens exchange information through one shared similarity matrix per layer:
softmax over tokens updates the latents, softmax over latents (the transpose) updates the tokens; the latents then
refine themselves with self-attention. Cost is O(M * N) per layer, linear in the number of tokens. The last layer
is one-sided (latents only), as in the official code.

Parameter names and shapes follow the official ``mrkshllr/BiXT`` (``timm/models/bixt.py``), so its released
checkpoints load strictly; their fixed-grid ``fourier_pos_encode.pos`` buffer is dropped on load because the Fourier
encoding is recomputed for every input grid here (the official ``_dyn`` path), which is what makes any size work.

Global embedding: LayerNorm (``fc_norm``) of the mean of the latents. Dense descriptors: the tokens after the last
bi-directional layer, normed by the LN that the final one-sided layer applies to them (``norm1_pat``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from functools import partial

import torch
from timm.layers import DropPath, LayerScale, Mlp, lecun_normal_, trunc_normal_
from torch import Tensor, nn

from ssl_xcit.models.base import Backbone
from ssl_xcit.models.layers import PositionalEncodingFourier

_TI = dict(embed_dim=192, depth=12, num_heads=6)  # official code: 6 heads of 32 dims (the v1 paper says 3)
_S = dict(
    embed_dim=384, depth=12, num_heads=12
)  # paper Table 5 "small"; heads not stated, head dim 32 as tiny
VARIANTS: dict[str, dict] = {
    "bixt_ti_l64_p16": dict(_TI, num_latents=64, stride=16),
    "bixt_ti_l64_p16s8": dict(_TI, num_latents=64, stride=8),
    "bixt_ti_l64_p16s4": dict(_TI, num_latents=64, stride=4),
    "bixt_ti_l32_p16": dict(_TI, num_latents=32, stride=16),
    "bixt_ti_l128_p16": dict(_TI, num_latents=128, stride=16),
    "bixt_ti_l32_p16s8": dict(_TI, num_latents=32, stride=8),
    "bixt_ti_l128_p16s8": dict(_TI, num_latents=128, stride=8),
    "bixt_ti_l64_d13_p16": dict(_TI, depth=13, num_latents=64, stride=16),  # dense-task pretraining depth
    "bixt_s_l32_p16": dict(_S, num_latents=32, stride=16),
    "bixt_s_l64_p16": dict(_S, num_latents=64, stride=16),
    "bixt_s_l128_p16": dict(_S, num_latents=128, stride=16),
}

_Norm = partial(nn.LayerNorm, eps=1e-6)


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
        self.norm1 = _Norm(dim)
        self.attn = SelfAttention(dim, num_heads, qkv_bias, attn_drop, drop)
        self.ls1, self.drop_path1 = _residual(dim, init_values, drop_path)
        self.norm2 = _Norm(dim)
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
        self.norm1_lat, self.norm1_pat = _Norm(dim), _Norm(dim)
        self.attn = CrossAttention(dim, num_heads, rv_bias, attn_drop, drop, one_sided=one_sided)
        self.ls1_lat, self.drop_path1_lat = _residual(dim, init_values, drop_path)
        self.norm2_lat = _Norm(dim)
        self.mlp_lat = Mlp(dim, int(dim * mlp_ratio), drop=drop)
        self.ls2_lat, self.drop_path2_lat = _residual(dim, init_values, drop_path)
        if not one_sided:
            self.ls1_pat, self.drop_path1_pat = _residual(dim, init_values, drop_path)
            self.norm2_pat = _Norm(dim)
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


class BiXT(Backbone):
    """BiXT with official parameter names; inputs of any size whose sides are multiples of the token stride.

    Args:
        embed_dim, depth, num_heads, num_latents: width, layers (the last one-sided), heads, latents M.
        patch_size, stride: tokenizer kernel and stride (16/16, 16/8 or 16/4 for BiXT-Ti/16, /8, /4).
        mlp_ratio, qkv_bias, rv_bias, init_values: MLP width, projection biases, LayerScale init (None = off).
        drop_rate, attn_drop_rate: dropout on projections / attention weights.
        sa_drop_path_rate, ca_drop_path_rate: stochastic depth of the latent self-attention blocks and of both
            streams of the cross-attention blocks, each linear from 0 over depth (official rule).
        drop_path_rate: when given, the rate of both (the toolkit's common stochastic-depth argument; the v1
            paper uses one value, 0.05, for SA and CA).
        num_classes: linear head on the embedding (zero-initialised); 0 returns the embedding.
        name: registry name, for error messages and checkpoint metadata.
    """

    family = "bixt"
    has_attention_maps = True

    def __init__(
        self,
        embed_dim: int = 192,
        depth: int = 12,
        num_heads: int = 6,
        num_latents: int = 64,
        patch_size: int = 16,
        stride: int = 16,
        in_chans: int = 3,
        num_classes: int = 0,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        rv_bias: bool = True,
        init_values: float | None = None,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        sa_drop_path_rate: float = 0.0,
        ca_drop_path_rate: float = 0.0,
        drop_path_rate: float | None = None,
        name: str = "bixt",
    ) -> None:
        super().__init__()
        if depth < 2:
            raise ValueError(
                f"BiXT needs depth >= 2 (bi-directional layers + the one-sided last), got {depth}"
            )
        if drop_path_rate is not None:
            sa_drop_path_rate = ca_drop_path_rate = drop_path_rate
        self.name = name
        self.num_classes = num_classes
        self.num_features = self.embed_dim = self.dense_dim = embed_dim
        self.depth = depth
        self.size_multiple = stride
        self.grad_checkpointing = False

        self.patch_embed = PatchEmbed(patch_size, stride, in_chans, embed_dim)
        self.fourier_pos_encode = PositionalEncodingFourier(hidden_dim=32, dim=embed_dim)
        self.pos_drop_pat = nn.Dropout(drop_rate)
        self.latents = nn.Parameter(torch.zeros(1, num_latents, embed_dim))

        def rate(r: float, i: int) -> float:
            return r * i / (depth - 1)  # torch.linspace(0, r, depth)[i], without a tensor (meta-safe)

        self.blocks = nn.ModuleList(
            BiXTBlock(
                embed_dim,
                num_heads,
                mlp_ratio,
                qkv_bias,
                rv_bias,
                drop_rate,
                attn_drop_rate,
                init_values,
                rate(sa_drop_path_rate, i),
                rate(ca_drop_path_rate, i),
                one_sided=i == depth - 1,
            )  # fmt: skip
            for i in range(depth)
        )
        self.fc_norm = _Norm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self._register_load_state_dict_pre_hook(_drop_fixed_pos_buffer)
        self.init_weights()

    def init_weights(self) -> None:
        """Official 'jax' init: Linear xavier-uniform (MLP biases N(0, 1e-6)), convs lecun-normal, zero head."""
        trunc_normal_(self.latents, std=0.02)
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                if name.startswith("head"):
                    nn.init.zeros_(m.weight)
                else:
                    nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.normal_(m.bias, std=1e-6) if ".mlp" in name else nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Conv2d):
                lecun_normal_(m.weight)
                nn.init.zeros_(m.bias)

    def check_input(self, x: Tensor) -> None:
        """ValueError naming the size when a side is not a multiple of the tokenizer's stride."""
        try:
            super().check_input(x)
        except ValueError as err:
            if x.ndim != 4:
                raise
            raise ValueError(f"{err}; the tokenizer's stride is {self.size_multiple}") from None

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute block activations in the backward pass: less memory for long token sequences."""
        self.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        return {"latents"}

    # ------------------------------------------------------------------ forward
    def _run(self, x: Tensor, stop: int | None = None) -> Iterator[tuple[int, Tensor, Tensor, Tensor, tuple]]:
        """Yield (block index, latents, tokens, latents-to-tokens attention, grid) after each block."""
        self.check_input(x)
        pat, grid = self.patch_embed(x)
        pat = self.pos_drop_pat(pat + self.fourier_pos_encode(*grid).to(pat.dtype))
        lat = self.latents.to(pat.dtype)  # batch 1; the first attention broadcasts it to B
        for i, block in enumerate(self.blocks):
            if self.grad_checkpointing and torch.is_grad_enabled():
                lat, pat, attn = torch.utils.checkpoint.checkpoint(block, lat, pat, use_reentrant=False)
            else:
                lat, pat, attn = block(lat, pat)
            yield i, lat, pat, attn, grid
            if stop is not None and i >= stop:
                return

    def forward_features(self, x: Tensor) -> Tensor:
        """The latents (B, M, D) after the last layer (the official ``norm_lat`` is the identity with fc_norm)."""
        return deque(self._run(x), maxlen=1)[0][1]

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = self.fc_norm(x.mean(dim=1))
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        """``fc_norm`` of the mean latent (B, D) when ``num_classes == 0``, logits otherwise."""
        return self.forward_head(self.forward_features(x))

    def forward_patch_tokens(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """Tokens (B, N, D) after the last bi-directional layer, normed by the last layer's ``norm1_pat``."""
        _, _, pat, _, grid = deque(self._run(x, stop=self.depth - 2), maxlen=1)[0]
        return self.blocks[-1].cross_attention_latents_token.norm1_pat(pat), grid

    # -------------------------------------------------------- evaluation access
    def _indices(self, n: int | Sequence[int], count: int, what: str) -> list[int]:
        indices = list(range(count - n, count)) if isinstance(n, int) else [int(i) for i in n]
        bad = [i for i in indices if not -count <= i < count]
        if bad or not indices:
            raise ValueError(
                f"{what} indices {bad or indices} are out of range for {self.name}: 0 .. {count - 1}"
            )
        return sorted(i % count for i in indices)

    def get_intermediate_layers(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """Tokens (B, N, D) after chosen bi-directional layers (0 .. depth - 2; the last layer leaves tokens as
        they are), without a norm."""
        wanted = self._indices(n, self.depth - 1, "bi-directional layer")
        return [pat for i, _, pat, _, _ in self._run(x, stop=wanted[-1]) if i in wanted]

    def get_intermediate_cls(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """``fc_norm`` of the mean latent (B, D) after chosen layers; the last one equals ``forward``."""
        wanted = self._indices(n, self.depth, "layer")
        return [
            self.fc_norm(lat.mean(dim=1)) for i, lat, _, _, _ in self._run(x, stop=wanted[-1]) if i in wanted
        ]

    def get_attention_maps(self, x: Tensor) -> tuple[list[Tensor], tuple[int, int]]:
        """Per layer, the latents' attention over the tokens averaged over latents, (B, heads, N).

        Each latent's row is a softmax over tokens, so the mean is again a distribution over the patch grid, as a
        CLS attention map is: the tokens the global embedding reads from.
        """
        steps = list(self._run(x))
        return [attn.mean(dim=2) for _, _, _, attn, _ in steps], steps[-1][4]


def _drop_fixed_pos_buffer(state_dict: dict, prefix: str, *args) -> None:
    """Official fixed-grid checkpoints store the precomputed Fourier features; they are recomputed per grid here."""
    state_dict.pop(prefix + "fourier_pos_encode.pos", None)


def create(name: str, **overrides) -> BiXT:
    """Build a named variant; ``overrides`` replace constructor arguments (e.g. ``sa_drop_path_rate``)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown BiXT variant {name!r}; known: {', '.join(VARIANTS)}")
    return BiXT(**{**VARIANTS[name], **overrides, "name": name})
