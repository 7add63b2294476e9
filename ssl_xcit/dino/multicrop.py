"""Multi-crop plumbing of DINO: one backbone pass per crop resolution, the crops of a batch, frozen buffers."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ssl_xcit.dino.head import DINOHead
from ssl_xcit.dino.masked_bn import statistics_from_unmasked
from ssl_xcit.utils.compile import dynamic_batch


class MultiCropWrapper(nn.Module):
    """Backbone + head over a list of crops. Consecutive crops of the same resolution are concatenated and go
    through the backbone in one call (2 calls for 2 global + N local crops); the head then runs once on all
    embeddings. Output rows are view-major: [view0 batch, view1 batch, ...]. ``return_embeddings`` also
    returns the backbone embeddings (same row order), for regularisers on the backbone output (KoLeo).

    ``lockstep_crops`` (set by FSDP2's sharding when the student's blocks reshard after forward): a backbone
    with ``takes_input_lists`` (every family's, unless built with other block classes) takes all crop groups
    in one call, ``forward_cls_patches_list``, each block called once for all of them, so FSDP2 gathers it
    twice a step instead of twice per group. Each group is computed as in its own call (its BatchNorm
    statistics its own); only the order of drop path's random draws differs (block by block across the
    groups), which is why it is off by default: otherwise results are bitwise the separate calls'
    (tests/dino/test_lockstep_crops.py)."""

    lockstep_crops: bool = False

    def __init__(self, backbone: nn.Module, head: nn.Module, patch_head: nn.Module | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        # iBOT's patch head; None shares ``head`` (iBOT) or, without the iBOT term, keeps DINO's layout.
        if patch_head is not None:
            self.patch_head = patch_head

    _compile_patch_pass = False

    def compile_backbone(self) -> None:
        """``torch.compile`` the backbone in place (parameter names unchanged, so checkpoints stay portable)
        and its masked patch pass: ``forward_cls_patches`` is a plain method, which ``Module.compile()``
        (it compiles ``__call__``) never sees, and it carries most of an iBOT step's compute."""
        # Static shapes: DINO feeds exactly two crop sizes, so two graphs. With automatic dynamic shapes the
        # second size makes a symbolic-shape graph that inductor fails to build for XCiT on torch 2.14
        # ("cannot determine truth value of Relational", found by benchmarks/gpu_check.sh --dry-run). The
        # batch dimension alone is dynamic (`dynamic_batch` at every call), so a new batch size reuses them.
        self.backbone.compile(dynamic=False)
        self._compile_patch_pass = True

    def patch_logits(self, patch_tokens: torch.Tensor) -> torch.Tensor:
        """The patch head (or the shared head) on selected patch tokens (M, C) -> (M, K)."""
        head = getattr(self, "patch_head", None)
        return (head if head is not None else self.head)(patch_tokens)

    def forward_with_patches(
        self,
        crops: Sequence[torch.Tensor],
        masks: torch.Tensor | None = None,
        n_global: int = 2,
        bn_from_unmasked: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Head outputs and embeddings of all crops (as ``forward``), plus the patch tokens (G*B, N, C) of the
        first ``n_global`` crops, which go through the backbone together with ``masks`` (G*B, N) applied.
        ``bn_from_unmasked``: that pass's BatchNorm statistics come from its unmasked crops
        (``ssl_xcit.dino.masked_bn``)."""
        sizes = {tuple(c.shape[-2:]) for c in crops[:n_global]}
        if len(crops) < n_global or len(sizes) != 1:
            raise ValueError(
                f"iBOT needs {n_global} global crops of one size first, got sizes {sorted(sizes)}"
            )
        patch_pass = _compiled() if self._compile_patch_pass else _cls_patches
        stats = (
            statistics_from_unmasked(self.backbone, masks)
            if bn_from_unmasked and masks is not None
            else contextlib.nullcontext()
        )
        x = dynamic_batch(torch.cat(list(crops[:n_global])))
        mask = dynamic_batch(masks) if masks is not None else None
        if self._lockstep():
            groups = _resolution_groups(crops[n_global:])
            with stats:  # the masked BatchNorm statistics apply to the list's first input alone
                passes = self.backbone.forward_cls_patches_list([x, *groups], [mask] + [None] * len(groups))
            patches = passes[0][1]
            embedding = torch.cat([e for e, _ in passes])
            return self.head(embedding), embedding, patches
        with stats:
            embedding, patches = patch_pass(self.backbone, x, mask)
        embeddings = [embedding]
        if len(crops) > n_global:
            embeddings.append(self._embed(crops[n_global:]))
        embedding = torch.cat(embeddings)
        return self.head(embedding), embedding, patches

    def _lockstep(self) -> bool:
        return self.lockstep_crops and getattr(self.backbone, "takes_input_lists", False)

    def _embed(self, crops: Sequence[torch.Tensor]) -> torch.Tensor:
        groups = _resolution_groups(crops)
        if len(groups) > 1 and self._lockstep():
            return torch.cat([e for e, _ in self.backbone.forward_cls_patches_list(groups)])
        return torch.cat([self.backbone(x) for x in groups])

    def forward(
        self, crops: torch.Tensor | Sequence[torch.Tensor], return_embeddings: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if isinstance(crops, torch.Tensor):
            crops = [crops]
        embedding = self._embed(crops)
        output = self.head(embedding)
        return (output, embedding) if return_embeddings else output


def _resolution_groups(crops: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive crops of one resolution concatenated: one backbone input per group."""
    groups = []
    start = 0
    while start < len(crops):
        end = start + 1
        while end < len(crops) and crops[end].shape[-2:] == crops[start].shape[-2:]:
            end += 1
        groups.append(dynamic_batch(torch.cat(list(crops[start:end]))))
        start = end
    return groups


def _cls_patches(backbone: nn.Module, x: torch.Tensor, mask: torch.Tensor | None):
    return backbone.forward_cls_patches(x, mask=mask)


@functools.cache
def _compiled() -> Callable[..., Any]:
    # One compiled function for every backbone (the backbone is an argument): nothing compiled is stored on
    # a module, so deepcopy and pickling see a plain module. Made on first use: torch.compile imports dynamo.
    return torch.compile(_cls_patches, dynamic=False)


@contextlib.contextmanager
def buffers_preserved(module: nn.Module) -> Iterator[None]:
    """Restore ``module``'s buffers (BN running statistics) on exit: validation forwards in train mode must
    not leak validation images into the teacher's statistics."""
    saved = [b.detach().clone() for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, old in zip(module.buffers(), saved, strict=True):
                buf.copy_(old)


def crops_from_batch(batch: Any) -> list[torch.Tensor]:
    """The list of DINO's crop tensors of a batch: ``(crops, labels, indices)`` from the DINO datamodule, or a
    bare list of crops."""
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], (list, tuple, dict)):
        batch = batch[0]
    if isinstance(
        batch, dict
    ):  # {"crops": ..., "gram_crops": ...} with the Gram teacher's (ssl_xcit.dino.gram)
        batch = batch.get("crops", batch.get("images"))
    if isinstance(batch, torch.Tensor):
        return [batch]
    if not isinstance(batch, (list, tuple)) or not all(isinstance(c, torch.Tensor) for c in batch):
        raise TypeError(
            f"DINO expects a batch (crops, labels, indices) with crops a list of (B, 3, H, W) tensors, "
            f"got {type(batch).__name__}"
        )
    return list(batch)


def student_and_teacher(
    create: Callable[..., nn.Module],
    backbone: str,
    backbone_kwargs: dict[str, Any],
    drop_path_rate: float,
    head_args: dict[str, Any],
    patch_out_dim: int | None = None,
    masking: bool = False,
    mask_token: bool = True,
) -> tuple[MultiCropWrapper, MultiCropWrapper]:
    """DINO's student and teacher: backbone + head, the teacher an exact copy without drop path and without
    gradients. ``masking`` gives both backbones iBOT's mask token and, with ``patch_out_dim``, a patch head
    of their own, so that the teacher mirrors the student parameter for parameter (EMA, state dicts); the
    teacher never uses its token. ``mask_token`` false: iBOT's patch heads without the token, for a student that
    is never masked (DINOv3's distillation), so a backbone that cannot take masks (ConvNeXt) still trains."""
    # Construction order (backbones, patch heads, heads) fixes what the seeded initialisation draws.
    nets = [create(backbone, drop_path_rate=rate, **backbone_kwargs) for rate in (drop_path_rate, 0.0)]
    args = dict(head_args, in_dim=nets[0].embed_dim)
    patch_heads: list[DINOHead | None] = [None, None]
    if masking:
        for net in nets if mask_token else ():
            net.enable_masking()
        if patch_out_dim is not None:
            patch_heads = [DINOHead(**dict(args, out_dim=patch_out_dim)) for _ in nets]
    pair = [
        MultiCropWrapper(net, DINOHead(**args), patch) for net, patch in zip(nets, patch_heads, strict=True)
    ]
    student, teacher = pair
    teacher.load_state_dict(student.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False
    return student, teacher
