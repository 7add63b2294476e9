"""The ``features`` distillation objective: the student's tokens regress the frozen teacher's.

The student's CLS embedding and patch tokens, each through a linear layer to the teacher's width, regress the
teacher's tokens of the same view with a mean squared error (lightly-train's distillation: MSE between student
and teacher features of the same image). The teacher's tokens are normalised per token over the channels (a
layer norm without affine), so the target scale is the same for every teacher; its patch grid is resized
bilinearly to the student's. ``tests/dino/test_distill.py`` checks the loss against an independent formula.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class FeatureProjection(nn.Module):
    """The student's linear maps to the teacher's widths: CLS embedding and patch tokens."""

    def __init__(self, cls_in: int, patch_in: int, cls_out: int, patch_out: int) -> None:
        super().__init__()
        self.cls_proj = nn.Linear(cls_in, cls_out)
        self.patch_proj = nn.Linear(patch_in, patch_out)


def normalise_tokens(tokens: Tensor) -> Tensor:
    """Each token standardised over its channels (a layer norm without affine), in float32."""
    return F.layer_norm(tokens.float(), tokens.shape[-1:])


def align_grid(patches: Tensor, grid: tuple[int, int]) -> Tensor:
    """Patch tokens (B, h, w, C) resized bilinearly to ``grid`` (B, h', w', C); unchanged when equal."""
    if tuple(patches.shape[1:3]) == tuple(grid):
        return patches
    moved = F.interpolate(patches.permute(0, 3, 1, 2), size=grid, mode="bilinear", align_corners=False)
    return moved.permute(0, 2, 3, 1)


def features_loss(
    student_cls: Tensor, student_patches: Tensor, teacher_cls: Tensor, teacher_patches: Tensor
) -> tuple[Tensor, Tensor]:
    """(CLS term, patch term): mean squared errors of the projected student CLS (B, C) and patches (B, N, C)
    against the normalised teacher CLS and patches of the same shapes."""
    cls = F.mse_loss(student_cls.float(), normalise_tokens(teacher_cls))
    patch = F.mse_loss(student_patches.float(), normalise_tokens(teacher_patches))
    return cls, patch
