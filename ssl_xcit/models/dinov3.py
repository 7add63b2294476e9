"""DINOv3's ViTs (timm's ``Eva``: RoPE, 4 register tokens, LayerScale, SwiGLU in S+ and H+) as backbones.

``create_model("vit_small_patch16_dinov3")`` builds ``timm.create_model(name, num_classes=0,
global_pool="token")`` and adopts its modules, so parameter names are timm's (exports load strictly into
``timm.create_model(name)``) and outputs equal timm's forward. ``global_pool="token"``: the embedding is the
final-norm CLS, as DINOv3's ``x_norm_clstoken`` (timm's own default for these names is the patch mean).

RoPE is computed for each input's patch grid (coordinates normalised per side, as DINOv3 and timm do), so any
side that is a multiple of 16 works: 224 and 96 px DINO crops, 256 (the native size), high-resolution
retrieval. The 1 + 4 prefix tokens (CLS, then the registers DINOv3 calls ``storage_tokens``) take no RoPE and
never enter a patch grid.

iBOT's mask token replaces a masked patch's embedding right after the patch embedding, before CLS and
registers are prepended, and the RoPE of its position still applies inside attention: DINOv3's
``prepare_tokens_with_masks``.

Meta's checkpoint layout (the hub files) is read by :func:`convert_state_dict`: ``storage_tokens``,
``ls1.gamma`` / ``ls2.gamma``, SwiGLU's ``w1`` / ``w2`` / ``w3``, a fused ``qkv.bias`` (with its
``bias_mask``) whose key part must be zero, and ``rope_embed.periods``, which must equal the periods this
model computes (at the file's precision: Meta stores them rounded).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Mapping, Sequence

import timm
import torch
from timm.models import eva
from timm.models.eva import Eva
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ssl_xcit.errors import UserError
from ssl_xcit.models.base import Backbone, ListForward, give_list_forward, input_masks, per_input

# Width of each size timm registers (``_qkvb``: the variants with q and v biases, as Meta's S and S+ have).
_WIDTHS = {
    "tiny": 192,
    "small": 384,
    "small_plus": 384,
    "base": 768,
    "large": 1024,
    "huge_plus": 1280,
    "7b": 4096,
}
_SIZE = re.compile(r"vit_(\w+?)_patch16_dinov3")
# Every DINOv3 ViT timm registers, smallest first.
VARIANTS: dict[str, dict] = {
    name: {"model_name": name}
    for name in sorted(
        (
            n
            for n in timm.list_models("vit_*_dinov3*")
            if _SIZE.match(n) and _SIZE.match(n).group(1) in _WIDTHS
        ),
        key=lambda n: (list(_WIDTHS).index(_SIZE.match(n).group(1)), n),
    )
}


class EvaBlock(ListForward, eva.EvaBlock):
    """timm's ``EvaBlock`` whose ``forward`` also takes a list of token tensors, with a list of their RoPE
    (``forward_cls_patches_list``, as DINOv3's blocks take lists); same name and parameters."""


class DinoV3ViT(Backbone, Eva):
    """A timm DINOv3 ``Eva`` (built by name) with the backbone accessors.

    Args:
        model_name: a timm DINOv3 ViT name (``timm.list_models("vit_*_dinov3*")``).
        num_classes: 0 (default) makes ``forward`` return the final-norm CLS embedding.
        global_pool: ``token`` (DINOv3's CLS, default) or any pooling timm's Eva takes.
        kwargs: any other ``timm.create_model`` argument (``depth``, ``embed_dim``, ``drop_path_rate``,
            ``rope_rescale_coords`` for DINOv3's train-time RoPE rescaling, ...).
    """

    family = "dinov3"
    supports_masking = True
    size_reason = "the patch embedding cuts 16-px patches"

    def __init__(
        self,
        model_name: str = "vit_small_patch16_dinov3",
        num_classes: int = 0,
        global_pool: str = "token",
        **kwargs,
    ) -> None:
        nn.Module.__init__(self)
        source = timm.create_model(
            model_name, pretrained=False, num_classes=num_classes, global_pool=global_pool, **kwargs
        )
        if type(source) is not Eva or source.rope is None or source.cls_token is None:
            raise UserError(f"{model_name!r} is not a timm DINOv3 ViT (an Eva with RoPE and a CLS token)")
        self.__dict__.update(source.__dict__)
        self.name = self.model_name = model_name
        self.dense_dim = self.embed_dim
        self.size_multiple = self.patch_size = self.patch_embed.patch_size[0]
        self.depth = len(self.blocks)
        self.has_attention_maps = True
        self.takes_input_lists = give_list_forward(self.blocks, {eva.EvaBlock: EvaBlock})

    # ------------------------------------------------------------------------------------------ forward
    def _tokens(self, x: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Prefix + patch tokens before the first block, and the RoPE of the patch grid."""
        self.check_input(x)
        x = self._apply_mask(self.patch_embed(x), mask)  # (B, h, w, C): the mask token before RoPE and prefix
        x, rope = self._pos_embed(x)
        return self.norm_pre(x), rope

    def _block(
        self, block: nn.Module, x: Tensor | list[Tensor], rope: Tensor | list | None
    ) -> Tensor | list[Tensor]:
        if self.grad_checkpointing and torch.is_grad_enabled():
            return checkpoint(block, x, rope=rope, use_reentrant=False)
        return block(x, rope=rope)

    def forward_cls_patches_list(
        self, xs: list[Tensor], masks: list[Tensor | None] | None = None
    ) -> list[tuple[Tensor, Tensor]]:
        """``forward_cls_patches`` of each input, each block called once with the list of all inputs' tokens
        and their RoPE (DINOv3's ``forward_features_list``)."""
        if not self.takes_input_lists:
            return super().forward_cls_patches_list(xs, masks)
        prepared = per_input(self._tokens, list(xs), input_masks(xs, masks))
        tokens, ropes = [t for t, _ in prepared], [r for _, r in prepared]
        for block in self.blocks:
            tokens = self._block(block, tokens, ropes)
        tokens = [self.norm(t) for t in tokens]
        return [(self.forward_head(t, pre_logits=True), t[:, self.num_prefix_tokens :]) for t in tokens]

    def _run(self, x: Tensor, mask: Tensor | None = None, upto: int | None = None):
        """Yield (block index, all tokens after the block) up to block ``upto`` (the last by default)."""
        x, rope = self._tokens(x, mask)
        last = len(self.blocks) - 1 if upto is None else upto
        for i, block in enumerate(self.blocks[: last + 1]):
            x = self._block(block, x, rope)
            yield i, x

    def forward_features(
        self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False, mask: Tensor | None = None
    ) -> Tensor:
        """All tokens (B, 5 + N, C) after the final norm, as timm's; ``mask`` (B, N) bool puts the mask token
        in place of masked patches (``enable_masking``)."""
        self.check_input(x)
        if mask is None:
            return super().forward_features(x, attn_mask=attn_mask, is_causal=is_causal)
        if attn_mask is not None or is_causal:
            raise ValueError("a patch mask cannot be combined with attn_mask or is_causal")
        _, tokens = deque(self._run(x, mask), maxlen=1)[0]
        return self.norm(tokens)

    def _grid(self, x: Tensor) -> tuple[int, int]:
        return x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size

    def forward_patch_tokens(self, x: Tensor, mask: Tensor | None = None) -> tuple[Tensor, tuple[int, int]]:
        """Final-norm patch tokens (B, N, C), CLS and registers removed, and their grid."""
        return self.forward_features(x, mask=mask)[:, self.num_prefix_tokens :], self._grid(x)

    # -------------------------------------------------------------------------------- evaluation access
    def _block_outputs(self, x: Tensor, n: int | Sequence[int]) -> list[Tensor]:
        wanted = self._block_indices(n)
        return [t for i, t in self._run(x, upto=wanted[-1]) if i in wanted]

    def get_intermediate_layers(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """Patch tokens (B, N, C) output by the chosen blocks (no final norm), CLS and registers removed."""
        return [t[:, self.num_prefix_tokens :] for t in self._block_outputs(x, n)]

    def get_intermediate_cls(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """The pooled embedding (CLS after the final norm) of each chosen block."""
        return [self.forward_head(self.norm(t), pre_logits=True) for t in self._block_outputs(x, n)]

    def get_dense_layers(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """Patch tokens (B, N, C) of the chosen blocks after the final norm, CLS and registers removed (what
        DINOv3's segmentation probe reads: ``get_intermediate_layers(..., norm=True)``)."""
        return [self.norm(t)[:, self.num_prefix_tokens :] for t in self._block_outputs(x, n)]

    def get_attention_maps(self, x: Tensor) -> tuple[list[Tensor], tuple[int, int]]:
        """The CLS query's attention over the patches in the last block (B, heads, h*w) (RoPE applied,
        registers left out), and the grid."""
        attn = self.blocks[-1].attn
        captured: list[Tensor] = []
        # timm's unfused path forms the softmaxed attention and passes it through attn_drop: read it there.
        handle = attn.attn_drop.register_forward_hook(lambda _m, _i, out: captured.append(out))
        fused, attn.fused_attn = attn.fused_attn, False
        try:
            deque(self._run(x), maxlen=0)
        finally:
            attn.fused_attn = fused
            handle.remove()
        return [captured[-1][:, :, 0, self.num_prefix_tokens :]], self._grid(x)


# ---------------------------------------------------------------------------------- Meta's checkpoint layout
_META_RENAMES = (
    ("storage_tokens", "reg_token"),
    (".ls1.gamma", ".gamma_1"),
    (".ls2.gamma", ".gamma_2"),
    (".mlp.w1.", ".mlp.fc1_g."),
    (".mlp.w2.", ".mlp.fc1_x."),
    (".mlp.w3.", ".mlp.fc2."),
)
_PERIODS = "rope_embed.periods"


def is_meta_layout(state: Mapping[str, Tensor]) -> bool:
    """Meta's own DINOv3 ViT naming (the hub files), told by its register tokens' name."""
    return "storage_tokens" in state and "blocks.0.attn.wq.weight" not in state


def _split_qkv_bias(
    key: str, state: Mapping[str, Tensor], model: nn.Module | None, own: set[str] | None
) -> dict[str, Tensor]:
    """Meta's fused ``qkv.bias`` as timm's ``q_bias`` / ``v_bias``. Its key part (held at 0 by Meta's
    ``bias_mask``) must be 0, since timm's Eva has none; a model without q/v biases takes only zero ones."""
    bias = state[key]
    mask = state.get(key + "_mask")
    if mask is not None:
        bias = bias * mask.to(bias.dtype)
    q, k, v = bias.chunk(3)
    base = key[: -len("qkv.bias")]
    if torch.count_nonzero(k):
        raise UserError(
            f"checkpoint key {key}: its key part is not zero (max |k| {k.abs().max():.3g}), "
            "which a DINOv3 ViT (timm's Eva) cannot hold"
        )
    if own is not None and base + "q_bias" not in own:
        if torch.count_nonzero(q) or torch.count_nonzero(v):
            raise UserError(
                f"checkpoint key {key} holds non-zero query/value biases, but {getattr(model, 'name', 'the model')} "
                "has none: use its _qkvb variant (e.g. vit_small_patch16_dinov3_qkvb)"
            )
        return {}
    return {base + "q_bias": q, base + "v_bias": v}


def _check_periods(periods: Tensor, model: nn.Module | None) -> None:
    """Meta stores RoPE's periods (fixed by the architecture); they must be the ones the model computes."""
    rope = getattr(model, "rope", None)
    if rope is None:
        return
    own = rope.periods.detach().to("cpu")
    if own.shape != periods.shape or not torch.equal(own.to(periods.dtype), periods):
        raise UserError(
            f"checkpoint key {_PERIODS} {periods.tolist()[:4]}... does not equal the RoPE periods of "
            f"{getattr(model, 'name', 'the model')} {own.tolist()[:4]}...: another RoPE base or min/max period"
        )


def convert_state_dict(state: Mapping[str, Tensor], model: nn.Module | None = None) -> dict[str, Tensor]:
    """Meta's DINOv3 ViT layout -> timm's names (anything else is returned as it is). Every tensor arrives
    by value or is checked and refused in one line: the key bias must be 0, the RoPE periods must be the
    model's; the mask token stays (DINO loads it into iBOT's, or drops it as from any released backbone)."""
    if not is_meta_layout(state):
        return dict(state)
    out: dict[str, Tensor] = {}
    own = set(model.state_dict()) if model is not None else None
    for key, value in state.items():
        if key.endswith("qkv.bias_mask"):
            continue  # applied to its bias in _split_qkv_bias
        if key == _PERIODS:
            _check_periods(value, model)
            continue
        if key.startswith("local_cls_norm."):
            continue  # the 7B's norm of local-crop CLS during pretraining; never used at evaluation
        if key.endswith("qkv.bias"):
            out.update(_split_qkv_bias(key, state, model, own))
            continue
        for old, new in _META_RENAMES:
            key = key.replace(old, new)
        out[key] = value
    return out


def infer_variant(state: Mapping[str, Tensor]) -> tuple[str, dict] | None:
    """The DINOv3 variant whose block shapes the (timm-named) state has; another depth comes back as an
    override."""
    if "reg_token" not in state or "blocks.0.gamma_1" not in state or "pos_embed" in state:
        return None
    from ssl_xcit.models.checkpoint import _variant_shapes

    depth = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
    width = state["reg_token"].shape[-1]
    shapes = {k: tuple(v.shape) for k, v in state.items() if not re.match(r"blocks\.[1-9]", k)}
    for name in VARIANTS:
        if _WIDTHS[_SIZE.match(name).group(1)] != width:
            continue  # not built: the widest take seconds even on the meta device
        own = _variant_shapes(name)
        if {k: v for k, v in own.items() if not re.match(r"blocks\.[1-9]", k)} == shapes:
            ref_depth = 1 + max(int(k.split(".")[1]) for k in own if k.startswith("blocks."))
            return name, ({} if depth == ref_depth else {"depth": depth})
    return None
