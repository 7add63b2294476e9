"""iBOT's patch term against an independent float64 computation of DINOv2's formula on constructed tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ssl_xcit.dino.ibot_loss import iBOTPatchLoss


def _log_softmax(row: np.ndarray) -> np.ndarray:
    shifted = row - row.max()
    return shifted - math.log(np.exp(shifted).sum())


def _sinkhorn(scores: np.ndarray, iterations: int = 3) -> np.ndarray:
    """DINOv2's Sinkhorn-Knopp, written out in float64: Q = exp(S)^T, then rows (prototypes) and columns
    (patches) normalised in turn, columns last, rescaled so each patch's target sums to 1."""
    q = np.exp(scores - scores.max()).T
    k, b = q.shape
    q = q / q.sum()
    for _ in range(iterations):
        q = q / q.sum(axis=1, keepdims=True) / k
        q = q / q.sum(axis=0, keepdims=True) / b
    return (q * b).T


def _reference(student, teacher, masks, student_temp, teacher_temp, centering, center):
    """-(1 / n_images) sum_images (1 / n_masked) sum_masked sum_k q log p, one loop per image and patch."""
    student, teacher, masks = student.astype(np.float64), teacher.astype(np.float64), np.asarray(masks)
    if centering == "sinkhorn_knopp":
        targets = _sinkhorn(teacher / teacher_temp)
    else:
        targets = np.stack([np.exp(_log_softmax((t - center) / teacher_temp)) for t in teacher])
    total, row = 0.0, 0
    for image in masks:
        n_masked = int(image.sum())
        image_sum = 0.0
        for masked in image:
            if masked:
                image_sum += float(-(targets[row] * _log_softmax(student[row] / student_temp)).sum())
                row += 1
        total += image_sum / max(n_masked, 1)
    return total / len(masks)


@pytest.mark.parametrize("centering", ["ema", "sinkhorn_knopp"])
def test_matches_float64_reference_with_unmasked_images(centering):
    gen = torch.Generator().manual_seed(0)
    n_images, n_patches, k = 6, 9, 16
    masks = torch.zeros(n_images, n_patches, dtype=torch.bool)
    masks[0, [0, 1, 2, 4]] = True  # 4 masked
    masks[2, 5] = True  # a single masked patch
    masks[3] = True  # all masked
    masks[5, [7, 8]] = True  # images 1 and 4 have no masked patch: they add 0 but still count
    m = int(masks.sum())
    student = torch.randn(m, k, generator=gen) * 3
    teacher = torch.randn(m, k, generator=gen) * 3
    loss_fn = iBOTPatchLoss(k, warmup_teacher_temp=0.04, teacher_temp=0.07, centering=centering)
    assert loss_fn.teacher_temp_at(0) == 0.07  # no warm-up epochs: the final temperature from the start
    center = torch.randn(1, k, generator=gen)
    loss_fn.center.copy_(center)
    out = loss_fn(student, teacher, masks, epoch=0, update_center=False)
    expected = _reference(
        student.numpy(), teacher.numpy(), masks.numpy(), 0.1, 0.07, centering, center.numpy()[0]
    )
    assert out.loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # Unequal masked counts (4, 1, 9, 2) and two unmasked images out of six: a mean over masked patches,
    # or over masked images only, would not match.


def test_teacher_temperature_schedule_and_ema_centre():
    k = 8
    loss_fn = iBOTPatchLoss(
        k, warmup_teacher_temp=0.02, teacher_temp=0.06, warmup_teacher_temp_epochs=4, center_momentum=0.9
    )
    # DINO's schedule: linspace over the warm-up epochs, then held.
    temps = [loss_fn.teacher_temp_at(e) for e in (0, 2, 4, 9)]
    assert temps == pytest.approx([0.02, 0.02 + 2 * 0.04 / 3, 0.06, 0.06])
    masks = torch.tensor([[True, False, True], [False, False, False]])
    teacher = torch.arange(2 * k, dtype=torch.float32).reshape(2, k)
    student = torch.zeros(2, k)
    loss_fn(student, teacher, masks, epoch=0)
    # The centre moves towards the mean teacher logit of the masked patches only.
    torch.testing.assert_close(loss_fn.center, 0.1 * teacher.mean(0, keepdim=True))
    out = loss_fn(student, teacher, masks, epoch=2)
    # Targets use the centre from before this call's update (as DINO and DINOv2 do).
    expected = _reference(
        student.numpy(),
        teacher.numpy(),
        masks.numpy(),
        0.1,
        0.02 + 2 * 0.04 / 3,
        "ema",
        0.1 * teacher.numpy().mean(0),
    )
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)


def test_no_masked_patch_gives_zero_and_keeps_the_graph():
    k = 4
    loss_fn = iBOTPatchLoss(k, centering="sinkhorn_knopp")
    student = torch.zeros(0, k, requires_grad=True)
    out = loss_fn(student, torch.zeros(0, k), torch.zeros(3, 5, dtype=torch.bool), epoch=0)
    assert out.loss.item() == 0.0
    out.loss.backward()  # a rank without masked patches still takes part in backward
    assert student.grad is not None


def test_count_mismatch_is_a_clear_error():
    loss_fn = iBOTPatchLoss(4)
    masks = torch.tensor([[True, True, False]])
    with pytest.raises(ValueError, match="3 student and 3 teacher patch outputs for 2 masked patches"):
        loss_fn(torch.zeros(3, 4), torch.zeros(3, 4), masks, epoch=0)
