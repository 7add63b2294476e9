"""Any plain timm Vision Transformer by name, with dynamic image size, behind the :class:`Backbone` interface.

``create_model("vit_small_patch16_224")`` builds ``timm.create_model(name, dynamic_img_size=True,
num_classes=0)`` and adopts its modules, so parameter names are timm's (checkpoints load strictly both ways) and
outputs at the native size equal timm's. The positional grid is resampled bicubically by timm for other sizes
(96 px DINO crops, high-resolution retrieval). Any name timm registers as a plain ``VisionTransformer``
(``timm.list_models("vit_*")``) works; ``VARIANTS`` lists the ones of the DINO and XCiT papers' comparisons.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import timm
import torch
from timm.models import vision_transformer
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ssl_xcit.errors import UserError
from ssl_xcit.models.base import (
    AttentionNotSupported,
    Backbone,
    ListForward,
    give_list_forward,
    input_masks,
    per_input,
)

VARIANTS: dict[str, dict] = {
    name: {"model_name": name}
    for name in (
        "vit_tiny_patch16_224",
        "vit_small_patch16_224",  # DINO / XCiT papers' ViT-S/16
        "vit_small_patch8_224",  # ViT-S/8
        "vit_base_patch16_224",
        "vit_base_patch8_224",
        "vit_large_patch16_224",
    )
}
_WIDTHS = {"tiny": 192, "small": 384, "base": 768, "large": 1024}


class Block(ListForward, vision_transformer.Block):
    """timm's ViT ``Block`` whose ``forward`` also takes a list of token tensors (``forward_cls_patches_list``);
    same name and parameters. :class:`TimmViT` gives its timm blocks this class in place."""


class TimmViT(Backbone, VisionTransformer):
    """A timm ``VisionTransformer`` (built by name) with dynamic image size and the backbone accessors.

    Args:
        model_name: a timm model name whose class is plain ``VisionTransformer``.
        num_classes: 0 (default) makes ``forward`` return the pooled (CLS) embedding.
        kwargs: any other ``timm.create_model`` argument (``drop_path_rate``, ``depth``, ``img_size``, ...).
    """

    family = "vit"
    supports_masking = True

    def __init__(self, model_name: str = "vit_small_patch16_224", num_classes: int = 0, **kwargs) -> None:
        nn.Module.__init__(self)
        kwargs.setdefault("dynamic_img_size", True)
        refusal = (
            f"{model_name!r} is not a plain timm VisionTransformer (no dynamic image size); the vit family takes "
            "names like vit_small_patch16_224"
        )
        try:
            source = timm.create_model(model_name, pretrained=False, num_classes=num_classes, **kwargs)
        except TypeError as error:  # other ViT classes (relpos, ...) do not take dynamic_img_size
            if "dynamic_img_size" in str(error):
                raise UserError(refusal) from error
            raise
        if type(source) is not VisionTransformer:
            raise UserError(refusal + f" (it is a {type(source).__name__})")
        # Adopt the timm module's state (parameters, submodules, attributes): same names, same behaviour.
        self.__dict__.update(source.__dict__)
        self.name = model_name
        self.model_name = model_name
        self.dense_dim = self.embed_dim
        self.size_multiple = self.patch_size = self.patch_embed.patch_size[0]
        self.depth = len(self.blocks)
        self.has_attention_maps = self.cls_token is not None
        # timm's plain blocks take lists; a variant with other blocks (parallel ones) keeps a pass per input.
        self.takes_input_lists = give_list_forward(self.blocks, {vision_transformer.Block: Block})

    def _tokens(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        self.check_input(x)
        # Non-overlapping patches: replacing a masked patch's embedding hides all of its pixels.
        x = self._apply_mask(self.patch_embed(x), mask)
        return self.norm_pre(self.patch_drop(self._pos_embed(x)))

    def forward_features(
        self,
        x: Tensor,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        mask: Tensor | None = None,
    ) -> Tensor:
        """All tokens (B, prefix + N, C) after the final norm, as timm, with a size check first. ``mask``
        (B, N) bool replaces masked patches with the mask token (``enable_masking``)."""
        self.check_input(x)
        if mask is None:
            return super().forward_features(x, attn_mask=attn_mask, is_causal=is_causal)
        if attn_mask is not None or is_causal:
            raise ValueError("a patch mask cannot be combined with attn_mask or is_causal")
        x = self._tokens(x, mask)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self._checkpointing() else block(x)
        return self.norm(x)

    def forward_cls_patches_list(
        self, xs: list[Tensor], masks: list[Tensor | None] | None = None
    ) -> list[tuple[Tensor, Tensor]]:
        """``forward_cls_patches`` of each input, each block called once with the list of all inputs' tokens."""
        if not self.takes_input_lists:
            return super().forward_cls_patches_list(xs, masks)
        tokens = per_input(self._tokens, list(xs), input_masks(xs, masks))
        for block in self.blocks:
            tokens = (
                checkpoint(block, tokens, use_reentrant=False) if self._checkpointing() else block(tokens)
            )
        tokens = [self.norm(t) for t in tokens]
        return [(self.forward_head(t, pre_logits=True), t[:, self.num_prefix_tokens :]) for t in tokens]

    def _checkpointing(self) -> bool:
        return self.grad_checkpointing and torch.is_grad_enabled() and not torch.jit.is_scripting()

    def _grid(self, x: Tensor) -> tuple[int, int]:
        return x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size

    def forward_patch_tokens(self, x: Tensor, mask: Tensor | None = None) -> tuple[Tensor, tuple[int, int]]:
        """Final-norm patch tokens (B, N, C) (prefix tokens removed) and their grid."""
        return self.forward_features(x, mask=mask)[:, self.num_prefix_tokens :], self._grid(x)

    def _block_outputs(self, x: Tensor, n: int | Sequence[int]) -> list[Tensor]:
        wanted = self._block_indices(n)
        x = self._tokens(x)
        outputs = []
        for i, block in enumerate(self.blocks[: wanted[-1] + 1]):
            x = block(x)
            if i in wanted:
                outputs.append(x)
        return outputs

    def get_intermediate_layers(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """Patch tokens (B, N, C) output by the chosen blocks (no final norm), prefix tokens removed."""
        return [t[:, self.num_prefix_tokens :] for t in self._block_outputs(x, n)]

    def get_intermediate_cls(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """The pooled embedding (CLS after the final norm, as DINO's ViT linear probe) of each chosen block."""
        return [self.forward_head(self.norm(t), pre_logits=True) for t in self._block_outputs(x, n)]

    def get_dense_layers(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """Patch tokens (B, N, C) of the chosen blocks after the final norm, prefix tokens removed (DINOv2's
        ``get_intermediate_layers(..., norm=True)``)."""
        return [self.norm(t)[:, self.num_prefix_tokens :] for t in self._block_outputs(x, n)]

    def get_attention_maps(self, x: Tensor) -> tuple[list[Tensor], tuple[int, int]]:
        """The CLS query's attention over the patches in the last block, (B, heads, h*w), and the grid."""
        if self.cls_token is None:
            raise AttentionNotSupported(f"{self.name} has no class token, so no CLS attention map")
        tokens = self._tokens(x)
        for block in self.blocks[:-1]:
            tokens = block(tokens)
        last = self.blocks[-1]
        attn = last.attn
        u = last.norm1(tokens)
        b, n, _ = u.shape
        q, k, _ = attn.qkv(u).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = attn.q_norm(q), attn.k_norm(k)
        weights = (q[:, :, :1] * attn.scale @ k.transpose(-2, -1)).softmax(dim=-1)
        return [weights[:, :, 0, self.num_prefix_tokens :]], self._grid(x)


def resolve_name(name: str) -> tuple[str, dict] | None:
    """Any timm ``vit_*`` name (the class is checked when the model is built)."""
    if name.startswith("vit_") and timm.is_model(name):
        return name, {"model_name": name}
    return None


def infer_variant(state: Mapping[str, Tensor]) -> tuple[str, dict] | None:
    """A listed variant whose width and patch size the state dict has (other depth or size as overrides)."""
    needed = ("cls_token", "pos_embed", "patch_embed.proj.weight", "blocks.0.attn.qkv.weight")
    if any(k not in state for k in needed) or any(
        k.startswith(("blocks_token_only.", "cls_attn")) for k in state
    ):
        return None
    width = state["cls_token"].shape[-1]
    patch = state["patch_embed.proj.weight"].shape[-1]
    depth = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
    side = round((state["pos_embed"].shape[1] - 1) ** 0.5) * patch
    for name in VARIANTS:
        size, p = re.match(r"vit_(\w+?)_patch(\d+)_", name).groups()
        if _WIDTHS.get(size) == width and int(p) == patch:
            with torch.device("meta"):
                ref_depth = len(TimmViT(name).blocks)
            overrides = {} if depth == ref_depth else {"depth": depth}
            return name, overrides | ({} if side == 224 else {"img_size": side})
    return None


def convert_state_dict(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Meta's DINOv2 layout (the hub files) -> timm's names; anything else is returned as it is.

    With registers, Meta's ``register_tokens`` become ``reg_token``, and Meta's position table, which has a row
    for CLS, becomes timm's (``no_embed_class``): that row is added to ``cls_token`` once, as the sum is all
    the network ever sees. The giant's fused SwiGLU ``w12`` / ``w3`` become ``fc1`` / ``fc2``."""
    out = dict(state)
    if "register_tokens" in out and "pos_embed" in out and "cls_token" in out:
        out["reg_token"] = out.pop("register_tokens")
        out["cls_token"] = out["cls_token"] + out["pos_embed"][:, :1]
        out["pos_embed"] = out["pos_embed"][:, 1:]
    if any(".mlp.w12." in k for k in out):
        out = {
            re.sub(r"\.mlp\.w12\.", ".mlp.fc1.", re.sub(r"\.mlp\.w3\.", ".mlp.fc2.", k)): v
            for k, v in out.items()
        }
    return out
