"""iBOT's masked patch distillation term, as DINOv2 computes it.

For every masked patch of the student's global crops, the student's patch-head prediction is trained towards
the teacher's (centred, sharpened) patch-head target at the same position of the *unmasked* crop:

    loss = -(1 / n_images) * sum_images (1 / n_masked(image)) * sum_{masked j} sum_k q_jk log p_jk

with q the teacher's target (Sinkhorn-Knopp over all masked patches of the global batch, or a softmax of the
EMA-centred logits at the teacher temperature) and p the student's softmax at the student temperature. Each
image weighs the same whatever its masked count (a per-image mean), and the sum over images is divided by
all global crops, masked or not: an image with no masked patch adds 0 and still counts (DINOv2's
``forward_masked``). ``tests/dino/test_ibot_loss.py`` checks this against an independent float64 computation.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ssl_xcit.dino.loss import DINOLossOutput, ema_center_, sinkhorn_knopp
from ssl_xcit.dino.schedules import teacher_temperature
from ssl_xcit.errors import UserError


class iBOTPatchLoss(nn.Module):  # noqa: N801 (the method's name)
    """Cross-entropy between teacher targets and student predictions at masked patches.

    Args:
        out_dim: prototypes K of the patch head.
        warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs: the term's own teacher temperature
            schedule (DINOv2 uses the DINO term's values: 0.04 -> 0.07 over 30 epochs).
        student_temp: 0.1, as for the DINO term.
        center_momentum: EMA factor of the patch centre (``ema`` centring).
        centering: ``ema`` or ``sinkhorn_knopp``, like the DINO term.
        sinkhorn_iterations: 3 in DINOv2.
    """

    def __init__(
        self,
        out_dim: int,
        warmup_teacher_temp: float = 0.04,
        teacher_temp: float = 0.04,
        warmup_teacher_temp_epochs: int = 0,
        student_temp: float = 0.1,
        center_momentum: float = 0.9,
        centering: Literal["ema", "sinkhorn_knopp"] = "ema",
        sinkhorn_iterations: int = 3,
    ) -> None:
        super().__init__()
        if centering not in ("ema", "sinkhorn_knopp"):
            raise UserError(f"centering must be 'ema' or 'sinkhorn_knopp', got {centering!r}")
        self.out_dim = out_dim
        self.warmup_teacher_temp = warmup_teacher_temp
        self.teacher_temp = teacher_temp
        self.warmup_teacher_temp_epochs = warmup_teacher_temp_epochs
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.centering = centering
        self.sinkhorn_iterations = sinkhorn_iterations
        self.register_buffer("center", torch.zeros(1, out_dim))

    def teacher_temp_at(self, epoch: int) -> float:
        return teacher_temperature(
            epoch, self.warmup_teacher_temp, self.teacher_temp, self.warmup_teacher_temp_epochs
        )

    def forward(
        self,
        student_patch_logits: torch.Tensor,
        teacher_patch_logits: torch.Tensor,
        masks: torch.Tensor,
        epoch: int,
        update_center: bool = True,
    ) -> DINOLossOutput:
        """``student_patch_logits`` and ``teacher_patch_logits``: (M, K) at the M masked patches, in the row
        order of ``masks[masks]``; ``masks``: (n_images, N) bool over the student's global crops."""
        n_masked = int(masks.sum())
        if student_patch_logits.shape[0] != n_masked or teacher_patch_logits.shape[0] != n_masked:
            raise ValueError(
                f"iBOT got {student_patch_logits.shape[0]} student and {teacher_patch_logits.shape[0]} teacher "
                f"patch outputs for {n_masked} masked patches"
            )
        student = student_patch_logits.float()
        teacher = teacher_patch_logits.float().detach()
        temp = self.teacher_temp_at(epoch)
        if self.centering == "sinkhorn_knopp":
            targets = sinkhorn_knopp(teacher / temp, self.sinkhorn_iterations)
        else:
            targets = F.softmax((teacher - self.center) / temp, dim=-1)
        per_patch = torch.sum(-targets * F.log_softmax(student / self.student_temp, dim=-1), dim=-1)
        # 1 / (masked patches of its image) for each masked patch, in masks[masks] order.
        weights = (1.0 / masks.sum(-1).clamp(min=1).float()).unsqueeze(-1).expand_as(masks)[masks]
        loss = (per_patch * weights).sum() / max(masks.shape[0], 1)

        with torch.no_grad():
            if n_masked:
                entropy = -(targets * torch.log(targets.clamp_min(1e-12))).sum(-1).mean()
                mean_probs = targets.mean(0)
                kl = (mean_probs * torch.log(mean_probs.clamp_min(1e-12))).sum() + math.log(self.out_dim)
            else:
                entropy = kl = student.new_zeros(())
        if update_center and self.centering == "ema":
            ema_center_(self.center, teacher, self.center_momentum)
        return DINOLossOutput(loss, entropy, kl)
