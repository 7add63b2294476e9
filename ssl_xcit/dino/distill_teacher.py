"""The frozen teacher of a distillation (``--model.teacher SOURCE``): reading SOURCE, and its tokens.

SOURCE is anything ``--model.init_from`` reads (a checkpoint or export of ours, an official DINO file) or
``timm:NAME[@FILE]`` for a timm model whose ``forward_features`` gives tokens (B, prefix + N, C). The teacher's
embedding (the CLS target) is its class token after the final norm when it has one; a timm model without a
class token (SigLIP's ViTs, ``class_token=False``) gives its pooled embedding instead,
``forward_head(tokens, pre_logits=True)`` (its attention pool or average), never a patch token. A model with
neither a class token nor a pooling head is refused in one line.
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from ssl_xcit.dino.head import DINOHead
from ssl_xcit.dino.init_from import (
    TIMM_PREFIX,
    nest_meta_layout,
    read_source_file,
    timm_model,
    weights_from_checkpoint,
)
from ssl_xcit.dino.mapped_source import read_mapped_checkpoint
from ssl_xcit.errors import UserError
from ssl_xcit.models.registry import as_backbone
from ssl_xcit.parallel.meta_start import record

OPTION = "--model.teacher"


def head_from_state(state: Mapping[str, Tensor]) -> DINOHead:
    """A :class:`DINOHead` of the shape ``state`` (a DINO head's state dict) has, loaded with it."""
    if "mlp.weight" in state:
        linears = [state["mlp.weight"]]
    else:
        index = sorted(
            int(m.group(1))
            for k in state
            if (m := re.fullmatch(r"mlp\.(\d+)\.weight", k)) and state[k].ndim == 2
        )
        linears = [state[f"mlp.{i}.weight"] for i in index]
    # DINO's and DINOv2's weight-normalised last layer, or DINOv3's plain one (Meta's training checkpoints).
    last = "last_layer.weight_v" if "last_layer.weight_v" in state else "last_layer.weight"
    if not linears or last not in state:
        raise UserError(
            f"not a DINO head state (keys {sorted(state)[:6]}): a DINO head has mlp.*.weight and "
            "last_layer.weight_v (DINO, DINOv2) or last_layer.weight (DINOv3)"
        )
    head = DINOHead(
        in_dim=linears[0].shape[1],
        out_dim=state[last].shape[0],
        use_bn=any(k.endswith("running_mean") for k in state),
        nlayers=len(linears),
        hidden_dim=linears[0].shape[0],
        bottleneck_dim=linears[-1].shape[0],
        last_layer="weight_norm" if last == "last_layer.weight_v" else "linear",
    )
    head.load_state_dict(dict(state), strict=True)
    return head


def has_class_token(model: nn.Module) -> bool:
    """Whether a timm model's tokens start with a class token (timm's ``has_class_token``, else a
    ``cls_token`` tensor)."""
    flag = getattr(model, "has_class_token", None)
    if flag is not None:
        return bool(flag)
    return isinstance(getattr(model, "cls_token", None), Tensor)


class FrozenTeacher(nn.Module):
    """The frozen teacher: a backbone (ours or timm's), the DINO and patch heads where SOURCE has them.

    ``tokens(x)`` gives the embedding (B, C) (the final-norm CLS, or the pooled embedding of a timm model
    without a class token) and the patch tokens on their grid (B, h, w, C'). It stays in eval mode
    (``train()`` is refused silently) and its parameters never require gradients."""

    def __init__(
        self,
        backbone: nn.Module,
        label: str,
        head: nn.Module | None = None,
        patch_head: nn.Module | None = None,
        probe_size: int = 224,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.label = label
        self.head = head
        self.patch_head = patch_head
        self.is_ours = hasattr(backbone, "forward_cls_patches")
        self.class_token = self.is_ours or has_class_token(backbone)
        for p in self.parameters():
            p.requires_grad_(False)
        self.train(False)
        with torch.no_grad():  # one probe: does it give tokens, and of which widths
            cls, patches = self.tokens(torch.zeros(1, 3, probe_size, probe_size))
        self.cls_dim, self.patch_dim = int(cls.shape[-1]), int(patches.shape[-1])

    def train(self, mode: bool = True) -> FrozenTeacher:
        return super().train(False)

    def tokens(self, x: Tensor) -> tuple[Tensor, Tensor]:
        height, width = x.shape[-2:]
        if self.is_ours:
            cls, patches = self.backbone.forward_cls_patches(x)
            grid = self.backbone.token_grid(height, width)
        else:
            cls, patches = self._timm_tokens(x)
            count = patches.shape[1]
            rows = round(math.sqrt(count * height / width)) if count else 0
            grid = (rows, count // rows) if rows and count % rows == 0 else (0, 0)
        if grid[0] * grid[1] != patches.shape[1] or not patches.shape[1]:
            raise UserError(
                f"{OPTION} {self.label}: its {patches.shape[1]} patch tokens of a {height}x{width} input do not "
                "form a patch grid; the teacher needs one token per patch"
            )
        return cls, patches.reshape(patches.shape[0], grid[0], grid[1], patches.shape[-1])

    def _timm_tokens(self, x: Tensor) -> tuple[Tensor, Tensor]:
        out = self.backbone.forward_features(x)
        if not isinstance(out, Tensor) or out.ndim != 3:
            shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise UserError(
                f"{OPTION} {self.label}: its forward_features gives {shape}, not tokens (B, prefix + N, C): the "
                "teacher needs patch tokens (a ViT-like model)"
            )
        # Prefix tokens: the class token and register tokens, which are not patches.
        prefix = int(getattr(self.backbone, "num_prefix_tokens", 1 if self.class_token else 0))
        if self.class_token:
            return out[:, 0], out[:, prefix:]
        pooled = self._pooled(out)
        return pooled, out[:, prefix:]

    def _pooled(self, tokens: Tensor) -> Tensor:
        """The embedding of a model without a class token: its own pooling (``forward_head(pre_logits)``)."""
        head = getattr(self.backbone, "forward_head", None)
        pooled = head(tokens, pre_logits=True) if callable(head) else None
        if not isinstance(pooled, Tensor) or pooled.ndim != 2:
            pool = getattr(self.backbone, "global_pool", None)
            raise UserError(
                f"{OPTION} {self.label}: it has no class token and no pooled embedding (global_pool {pool!r}) "
                "to stand for one; use a model with a class token or a pooling head (global_pool 'avg' or 'map')"
            )
        return pooled


def _timm_teacher(spec: str) -> nn.Module:
    """timm's model for ``timm:NAME[@FILE]``, headless; ViTs take any input size (``dynamic_img_size``)."""
    try:
        return timm_model(spec, OPTION, num_classes=0, dynamic_img_size=True)
    except TypeError:  # a family without the option (XCiT takes any size anyway)
        return timm_model(spec, OPTION, num_classes=0)


def read_teacher(source: str | None, on_meta: bool = False) -> FrozenTeacher:
    """The frozen teacher of SOURCE (see the module docstring); one-line ``UserError`` for a bad source.

    ``on_meta`` (FSDP2's meta-device start): a one-file SOURCE is read memory-mapped and the backbone is built
    and loaded on the meta device, recorded (``ssl_xcit.parallel.meta_start``); its ``meta_recipe`` fills each
    rank's shards after sharding (``Distill.configure_model``), one tensor at a time, so no rank ever holds it
    whole. The heads are read whole."""
    from ssl_xcit.models.checkpoint import backbone_from_checkpoint

    source = "" if source is None else str(source).strip()
    if not source:
        raise UserError(f"{OPTION} is required: a .ckpt, .safetensors or .pth, or timm:NAME[@FILE]")
    if source.startswith(TIMM_PREFIX):
        model = _timm_teacher(source[len(TIMM_PREFIX) :])
        size = (getattr(model, "pretrained_cfg", None) or {}).get("input_size", (3, 224, 224))[-1]
        return FrozenTeacher(as_backbone(model, source[len(TIMM_PREFIX) :]), source, probe_size=int(size))
    mapped = read_mapped_checkpoint(source) if on_meta else None
    # One line for a missing or unreadable file (read_source_file's).
    checkpoint = nest_meta_layout(mapped if mapped is not None else read_source_file(source, OPTION))
    weights = weights_from_checkpoint(checkpoint, source)
    recording = record() if mapped is not None else contextlib.nullcontext()
    try:
        with recording as recipe, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter")  # recorded
            backbone = backbone_from_checkpoint(checkpoint, source)  # the file is read once, however large
    except UserError as error:
        raise UserError(f"{OPTION} {source}: {error}") from error
    heads = {
        part: head_from_state(weights.teacher[part])
        for part in ("head", "patch_head")
        if part in weights.teacher
    }
    with torch.device("meta") if recipe is not None else contextlib.nullcontext():  # the probe's input
        teacher = FrozenTeacher(backbone, source, probe_size=4 * backbone.size_multiple, **heads)
    teacher.meta_recipe = recipe
    return teacher
