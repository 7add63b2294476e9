"""timm's ConvNeXts (DINOv3's distilled ConvNeXt T/S/B/L: ``convnext_*.dinov3_lvd1689m``) as backbones.

``create_model("convnext_tiny")`` builds ``timm.create_model(name, num_classes=0)`` and adopts its modules
(timm's parameter names: exports load strictly into ``timm.create_model(name)``). As in DINOv3's ConvNeXt:

* the global embedding (the "CLS") is the final LayerNorm of the last stage's spatial mean, which is timm's
  headless forward;
* the patch tokens are the last stage's feature map, each position through the same final LayerNorm: a
  (H/32) x (W/32) grid (7 x 7 at 224, 3 x 3 for a 96-px crop).

Blocks are indexed over all stages (0 .. sum(depths) - 1), as for CrossFormer++. iBOT is refused: a
convolution mixes every patch with its neighbours before any token exists, so no per-patch token can be
replaced by a mask token (DINOv3 trains its ConvNeXts by distillation only). Gram anchoring works: it holds
the Gram matrix of the last stage's normed tokens. Meta's own ConvNeXt layout (``downsample_layers``,
``dwconv``, ``pwconv1``) is read by :func:`convert_state_dict`. timm's blocks take lists of inputs
(``forward_cls_patches_list``: each block called once for all of them, :class:`~ssl_xcit.models.base.ListForward`;
the stem and the downsamplings between stages, which are not FSDP2 units, run per input).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence

import timm
import torch
from timm.models import convnext
from timm.models.convnext import ConvNeXt
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ssl_xcit.errors import UserError
from ssl_xcit.models.base import Backbone, ListForward, give_list_forward, per_input

# Name -> stem width: a state dict of another width is not compared (building a variant takes a second).
_STEM_WIDTHS = {"convnext_tiny": 96, "convnext_small": 96, "convnext_base": 128, "convnext_large": 192}
VARIANTS: dict[str, dict] = {name: {"model_name": name} for name in _STEM_WIDTHS}


class ConvNeXtBlock(ListForward, convnext.ConvNeXtBlock):
    """timm's ``ConvNeXtBlock`` whose ``forward`` also takes a list of feature maps (``forward_cls_patches_list``);
    same name and parameters. :class:`TimmConvNeXt` gives its timm blocks this class in place."""


class TimmConvNeXt(Backbone, ConvNeXt):
    """A timm ``ConvNeXt`` (built by name) with the backbone accessors.

    Args:
        model_name: a timm ConvNeXt name (``convnext_tiny`` ... ``convnext_large`` hold DINOv3's weights).
        num_classes: 0 (default) makes ``forward`` return the normed pooled embedding.
        kwargs: any other ``timm.create_model`` argument (``depths``, ``dims``, ``drop_path_rate``, ...).
    """

    family = "convnext"
    supports_masking = False
    gives_patch_tokens = True
    masking_refusal = (
        "a convolution mixes each patch with its neighbours before any token exists, so no patch token can be "
        "swapped for a mask token"
    )
    size_reason = "the stem and three downsamplings divide each side by 32"

    def __init__(self, model_name: str = "convnext_tiny", num_classes: int = 0, **kwargs) -> None:
        nn.Module.__init__(self)
        source = timm.create_model(model_name, pretrained=False, num_classes=num_classes, **kwargs)
        if type(source) is not ConvNeXt or source.head.global_pool.pool_type != "avg":
            raise UserError(f"{model_name!r} is not a timm ConvNeXt with an average-pooled head")
        self.__dict__.update(source.__dict__)
        self.name = self.model_name = model_name
        self.embed_dim = self.dense_dim = self.num_features
        self.depths = tuple(len(stage.blocks) for stage in self.stages)
        self.depth = sum(self.depths)
        self.size_multiple = 32
        self.takes_input_lists = give_list_forward(
            (b for s in self.stages for b in s.blocks), {convnext.ConvNeXtBlock: ConvNeXtBlock}
        )

    def token_grid(self, height: int, width: int) -> tuple[int, int]:
        return height // 32, width // 32

    def forward_features(self, x: Tensor) -> Tensor:
        """The last stage's feature map (B, C, H/32, W/32), before the final norm (timm's)."""
        self.check_input(x)
        return super().forward_features(x)

    def _normed_tokens(self, feature_map: Tensor) -> Tensor:
        return self.head.norm(feature_map).flatten(2).transpose(1, 2)

    def forward_cls_patches(self, x: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The normed pooled embedding and the normed last-stage tokens (B, h*w, C) of one pass."""
        if mask is not None:
            self.enable_masking()  # refuses in one line
        feature_map = self.forward_features(x)
        return self.forward_head(feature_map, pre_logits=True), self._normed_tokens(feature_map)

    def forward_cls_patches_list(
        self, xs: list[Tensor], masks: list[Tensor | None] | None = None
    ) -> list[tuple[Tensor, Tensor]]:
        """``forward_cls_patches`` of each input, each block called once with the list of all inputs' feature
        maps; the stem and each stage's downsampling run per input. No masks (``masks`` all None)."""
        if masks is not None and any(m is not None for m in masks):
            self.enable_masking()  # refuses in one line
        if not self.takes_input_lists:
            return super().forward_cls_patches_list(xs)
        for x in xs:
            self.check_input(x)
        maps = per_input(self.stem, list(xs))
        for stage in self.stages:
            maps = per_input(stage.downsample, maps)
            for block in stage.blocks:
                use_checkpoint = stage.grad_checkpointing and torch.is_grad_enabled()  # timm's is per stage
                maps = checkpoint(block, maps, use_reentrant=False) if use_checkpoint else block(maps)
        maps = per_input(self.norm_pre, maps)
        return [(self.forward_head(m, pre_logits=True), self._normed_tokens(m)) for m in maps]

    def forward_patch_tokens(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """The last stage's tokens through the final norm (B, h*w, C), and their grid."""
        feature_map = self.forward_features(x)
        return self._normed_tokens(feature_map), tuple(feature_map.shape[-2:])

    # -------------------------------------------------------------------------------- evaluation access
    def _blocks(self, x: Tensor, stop: int) -> Iterator[tuple[int, int, Tensor]]:
        """Yield (global block index, stage, feature map after the block) up to block ``stop``."""
        self.check_input(x)
        x = self.stem(x)
        index = 0
        for s, stage in enumerate(self.stages):
            x = stage.downsample(x)
            for block in stage.blocks:
                use_checkpoint = stage.grad_checkpointing and torch.is_grad_enabled()  # timm's is per stage
                x = checkpoint(block, x, use_reentrant=False) if use_checkpoint else block(x)
                yield index, s, x
                if index == stop:
                    return
                index += 1

    def _block_indices(self, n: int | Sequence[int], total: int | None = None, detail: str = "") -> list[int]:
        detail = f" (stages of {list(self.depths)} blocks, indexed globally)"
        return super()._block_indices(n, self.depth, detail)

    def _intermediates(self, x: Tensor, n: int | Sequence[int]) -> list[tuple[int, Tensor]]:
        wanted = self._block_indices(n)
        return [(s, t) for i, s, t in self._blocks(x, wanted[-1]) if i in wanted]

    def get_intermediate_layers(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """Tokens (B, N_s, C_s) after the chosen blocks (no norm); width and grid are the block's stage's."""
        return [t.flatten(2).transpose(1, 2) for _, t in self._intermediates(x, n)]

    def get_dense_layers(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """Tokens (B, N_s, C_s) of the chosen blocks through the LayerNorm that follows their stage (the next
        downsampling's, or the final norm): the last block's are ``forward_patch_tokens``'s."""
        out = []
        for s, t in self._intermediates(x, n):
            norm = self.head.norm if s == len(self.stages) - 1 else self.stages[s + 1].downsample[0]
            out.append(norm(t).flatten(2).transpose(1, 2))
        return out

    def get_intermediate_cls(self, x: Tensor, n: int | Sequence[int] = 1) -> list[Tensor]:
        """Per chosen block, the spatial mean through the LayerNorm that follows its stage (the next
        downsampling's, or the final one), (B, C_s); for the last block this equals ``forward``."""
        out = []
        for s, t in self._intermediates(x, n):
            norm = self.head.norm if s == len(self.stages) - 1 else self.stages[s + 1].downsample[0]
            out.append(norm(t.mean(dim=(2, 3), keepdim=True)).flatten(1))
        return out


# ---------------------------------------------------------------------------------- Meta's checkpoint layout
def is_meta_layout(state: Mapping[str, Tensor]) -> bool:
    """Meta's ConvNeXt naming (DINOv3's ``convnext.py``, as in the original ConvNeXt code)."""
    return "downsample_layers.0.0.weight" in state


def _rename(key: str) -> str:
    key = key.replace("downsample_layers.0.", "stem.")
    key = re.sub(r"^downsample_layers\.(\d+)\.", r"stages.\1.downsample.", key)
    key = re.sub(r"^stages\.(\d+)\.(\d+)\.", r"stages.\1.blocks.\2.", key)
    key = (
        key.replace(".dwconv.", ".conv_dw.")
        .replace(".pwconv1.", ".mlp.fc1.")
        .replace(".pwconv2.", ".mlp.fc2.")
    )
    return "head.norm." + key[len("norm.") :] if key.startswith("norm.") else key


def convert_state_dict(state: Mapping[str, Tensor], model: nn.Module | None = None) -> dict[str, Tensor]:
    """Meta's ConvNeXt layout -> timm's names (anything else is returned as it is). ``norms.3`` is the final
    norm saved a second time (``norms`` lists it); it must equal ``norm``."""
    if not is_meta_layout(state):
        return dict(state)
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if key.startswith("norms."):
            twin = "norm." + key.split(".", 2)[2]
            if twin not in state or not torch.equal(state[twin], value):
                raise UserError(
                    f"checkpoint key {key} is not a copy of {twin}, as DINOv3's ConvNeXt saves it"
                )
            continue
        out[_rename(key)] = value
    return out


def infer_variant(state: Mapping[str, Tensor]) -> tuple[str, dict] | None:
    """The ConvNeXt variant whose shapes the (timm-named) state has exactly; only ConvNeXt states are matched."""
    if "stem.0.weight" not in state or "stages.0.blocks.0.conv_dw.weight" not in state:
        return None
    from ssl_xcit.models.checkpoint import _variant_shapes

    shapes = {k: tuple(v.shape) for k, v in state.items()}
    width = shapes["stem.0.weight"][0]
    candidates = (name for name in VARIANTS if _STEM_WIDTHS[name] == width)
    return next(((name, {}) for name in candidates if _variant_shapes(name) == shapes), None)


def resolve_name(name: str) -> tuple[str, dict] | None:
    """Any timm ``convnext_*`` name (the class is checked when the model is built)."""
    if name.startswith("convnext") and timm.is_model(name):
        return name, {"model_name": name}
    return None
