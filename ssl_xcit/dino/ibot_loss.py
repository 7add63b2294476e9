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

import torch
import torch.nn.functional as F

from ssl_xcit.dino.ibot import MaskedPatches
from ssl_xcit.dino.loss import DINOLossOutput, TeacherTargets
from ssl_xcit.dino.precision import float32_math


class iBOTPatchLoss(TeacherTargets):  # noqa: N801 (the method's name)
    """Cross-entropy between teacher targets and student predictions at masked patches.

    Args: those of :class:`~ssl_xcit.dino.loss.TeacherTargets` (its own temperature schedule, centring and
    centre): ``out_dim`` is the patch head's prototypes; DINOv2 uses the DINO term's temperatures.
    """

    def forward(
        self,
        student_patch_logits: torch.Tensor,
        teacher_patch_logits: torch.Tensor,
        masks: MaskedPatches | torch.Tensor,
        epoch: int,
        update_center: bool = True,
    ) -> DINOLossOutput:
        """``student_patch_logits`` and ``teacher_patch_logits``: (M, K) at the M masked patches, in the row
        order of ``masks[masks]``; ``masks``: the batch's :class:`~ssl_xcit.dino.ibot.MaskedPatches`, or a CPU
        (n_images, N) bool tensor over the student's global crops. The count and the weights come from the
        host: nothing here waits on the device."""
        if isinstance(masks, torch.Tensor):
            masks = MaskedPatches.from_host(masks.numpy(), student_patch_logits.device)
        if student_patch_logits.shape[0] != masks.count or teacher_patch_logits.shape[0] != masks.count:
            raise ValueError(
                f"iBOT got {student_patch_logits.shape[0]} student and {teacher_patch_logits.shape[0]} teacher "
                f"patch outputs for {masks.count} masked patches"
            )
        # Float32 with autocast off, as the DINO term (``DINOLoss._loss``).
        with float32_math(student_patch_logits.device):
            student = student_patch_logits.float()
            teacher = teacher_patch_logits.float()
            targets = self.targets(teacher, epoch)
            per_patch = torch.sum(-targets * F.log_softmax(student / self.student_temp, dim=-1), dim=-1)
            loss = (per_patch * masks.weights).sum() / max(masks.n_images, 1)
            entropy, kl = self.collapse_signals(targets)
            if update_center and self.centering == "ema":
                self.update_center(teacher)
        return DINOLossOutput(loss, entropy, kl)
