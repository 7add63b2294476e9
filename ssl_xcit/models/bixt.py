"""BiXT: bi-directional cross-attention transformer (Hiller et al., NeurIPS 2024).

M learned latents and N patch tokens exchange information through one shared similarity matrix per layer:
softmax over tokens updates the latents, softmax over latents (the transpose) updates the tokens; the latents then
refine themselves with self-attention. Cost is O(M * N) per layer, linear in the number of tokens. The last layer
is one-sided (latents only), as in the official code.

Parameter names and shapes follow the official ``mrkshllr/BiXT`` (``timm/models/bixt.py``), so its released
checkpoints load strictly; their fixed-grid ``fourier_pos_encode.pos`` buffer is dropped on load (by
:func:`convert_state_dict` before ``load_pretrained``'s strict comparison, and by a pre-hook for a plain
``load_state_dict``) because the Fourier encoding is recomputed for every input grid here (the official ``_dyn``
path, whose own loader drops the buffer too), which is what makes any size work.

Global embedding: LayerNorm (``fc_norm``) of the mean of the latents. Dense descriptors: the tokens after the last
bi-directional layer, normed by the LN that the final one-sided layer applies to them (``norm1_pat``). The
blocks take lists of inputs (``forward_cls_patches_list``: each block called once for all of them,
:class:`~ssl_xcit.models.base.ListForward`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence

import torch
from timm.layers import lecun_normal_, trunc_normal_
from torch import Tensor, nn

from ssl_xcit.errors import UserError
from ssl_xcit.models import bixt_layers
from ssl_xcit.models.base import Backbone, ListForward, per_input
from ssl_xcit.models.bixt_layers import Norm, PatchEmbed
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


class BiXTBlock(ListForward, bixt_layers.BiXTBlock):
    """:class:`ssl_xcit.models.bixt_layers.BiXTBlock` whose ``forward`` also takes lists of latents and of token
    tensors and returns the list of its ``(latents, tokens, attention)`` triples; same name and parameters."""


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
    takes_input_lists = True
    masking_refusal = (
        "its global embedding is the mean of the latents, which never attend to a masked token's own output "
        "in the last (one-sided) layer, and the /8 and /4 tokenizers overlap neighbouring patches"
    )

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
            raise UserError(
                f"BiXT needs depth >= 2 (bi-directional layers + the one-sided last), got {depth}"
            )
        if drop_path_rate is not None:
            sa_drop_path_rate = ca_drop_path_rate = drop_path_rate
        self.name = name
        self.num_classes = num_classes
        self.num_features = self.embed_dim = self.dense_dim = embed_dim
        self.depth = depth
        self.size_multiple = stride
        self.size_reason = f"the tokenizer's stride is {stride}"
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
        self.fc_norm = Norm(embed_dim)
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

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute block activations in the backward pass: less memory for long token sequences."""
        self.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        return {"latents"}

    # ------------------------------------------------------------------ forward
    def _run(self, x: Tensor, stop: int | None = None) -> Iterator[tuple[int, Tensor, Tensor, Tensor, tuple]]:
        """Yield (block index, latents, tokens, latents-to-tokens attention, grid) after each block."""
        pat, grid = self._embed(x)
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

    def _embed(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """The tokens (B, N, D) with their Fourier positional encoding, and the grid."""
        self.check_input(x)
        pat, grid = self.patch_embed(x)
        return self.pos_drop_pat(pat + self.fourier_pos_encode(*grid).to(pat.dtype)), grid

    def forward_cls_patches_list(
        self, xs: list[Tensor], masks: list[Tensor | None] | None = None
    ) -> list[tuple[Tensor, Tensor]]:
        """Per input, the global embedding (``forward`` of a headless model) and the tokens (B, N, D) after the
        last bi-directional layer (without a norm: the one that reads them belongs to the last block, an FSDP2
        unit of its own), each block called once with the lists of all inputs' latents and tokens. No masks
        (``masks`` all None)."""
        if masks is not None and any(m is not None for m in masks):
            self.enable_masking()  # refuses in one line
        pats = [pat for pat, _ in per_input(self._embed, list(xs))]
        lats = [self.latents.to(p.dtype) for p in pats]  # batch 1; the first attention broadcasts it to B
        for block in self.blocks:
            if self.grad_checkpointing and torch.is_grad_enabled():
                outputs = torch.utils.checkpoint.checkpoint(block, lats, pats, use_reentrant=False)
            else:
                outputs = block(lats, pats)
            lats, pats = [lat for lat, _, _ in outputs], [pat for _, pat, _ in outputs]
        return [(self.forward_head(lat, pre_logits=True), pat) for lat, pat in zip(lats, pats, strict=True)]

    def forward_patch_tokens(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """Tokens (B, N, D) after the last bi-directional layer, normed by the last layer's ``norm1_pat``."""
        _, _, pat, _, grid = deque(self._run(x, stop=self.depth - 2), maxlen=1)[0]
        return self.blocks[-1].cross_attention_latents_token.norm1_pat(pat), grid

    # -------------------------------------------------------- evaluation access
    def get_intermediate_layers(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """Tokens (B, N, D) after chosen bi-directional layers (0 .. depth - 2; the last layer leaves tokens as
        they are), without a norm."""
        wanted = self._block_indices(n, self.depth - 1, f" (bi-directional layers 0 .. {self.depth - 2})")
        return [pat for i, _, pat, _, _ in self._run(x, stop=wanted[-1]) if i in wanted]

    def get_intermediate_cls(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """``fc_norm`` of the mean latent (B, D) after chosen layers; the last one equals ``forward``."""
        wanted = self._block_indices(n, self.depth, f" (layers 0 .. {self.depth - 1})")
        return [
            self.fc_norm(lat.mean(dim=1)) for i, lat, _, _, _ in self._run(x, stop=wanted[-1]) if i in wanted
        ]

    def get_dense_layers(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """Tokens (B, N, D) after chosen bi-directional layers (0 .. depth - 2), each normed by the LN through
        which the next layer reads them (its ``norm1_pat``): BiXT has no final token norm, and the last layer
        gives ``forward_patch_tokens``."""
        wanted = self._block_indices(n, self.depth - 1, f" (bi-directional layers 0 .. {self.depth - 2})")
        return [
            self.blocks[i + 1].cross_attention_latents_token.norm1_pat(pat)
            for i, _, pat, _, _ in self._run(x, stop=wanted[-1])
            if i in wanted
        ]

    def get_attention_maps(self, x: Tensor) -> tuple[list[Tensor], tuple[int, int]]:
        """Per layer, the latents' attention over the tokens averaged over latents, (B, heads, N).

        Each latent's row is a softmax over tokens, so the mean is again a distribution over the patch grid, as a
        CLS attention map is: the tokens the global embedding reads from.
        """
        steps = list(self._run(x))
        return [attn.mean(dim=2) for _, _, _, attn, _ in steps], steps[-1][4]


# Official fixed-grid checkpoints store the precomputed Fourier features; they are recomputed per grid here.
FIXED_POS_BUFFER = "fourier_pos_encode.pos"


def _drop_fixed_pos_buffer(state_dict: dict, prefix: str, *args) -> None:
    state_dict.pop(prefix + FIXED_POS_BUFFER, None)


def convert_state_dict(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An official BiXT state dict in our layout: the same names without the fixed-grid ``fourier_pos_encode.pos``."""
    return {k: v for k, v in state_dict.items() if k != FIXED_POS_BUFFER}


def create(name: str, **overrides) -> BiXT:
    """Build a named variant; ``overrides`` replace constructor arguments (e.g. ``sa_drop_path_rate``)."""
    if name not in VARIANTS:
        raise UserError(f"unknown BiXT variant {name!r}; known: {', '.join(VARIANTS)}")
    return BiXT(**{**VARIANTS[name], **overrides, "name": name})
