from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ssl_xcit.dino.loss import DINOLoss


def reference_loss(student, teacher, center, ncrops, student_temp, temp):
    """Plain transcription of the reference loop."""
    s = (student / student_temp).chunk(ncrops)
    t = F.softmax((teacher - center) / temp, dim=-1).chunk(2)
    total, n = 0.0, 0
    for iq, q in enumerate(t):
        for v in range(ncrops):
            if v == iq:
                continue
            total += torch.sum(-q * F.log_softmax(s[v], dim=-1), dim=-1).mean()
            n += 1
    return total / n, n


def test_loss_matches_reference_loop_and_updates_center():
    torch.manual_seed(0)
    out_dim, batch, ncrops = 32, 5, 6
    loss_fn = DINOLoss(out_dim, warmup_teacher_temp=0.04, teacher_temp=0.07, warmup_teacher_temp_epochs=3)
    loss_fn.center.normal_()
    center0 = loss_fn.center.clone()
    student = torch.randn(ncrops * batch, out_dim)
    teacher = torch.randn(2 * batch, out_dim)
    out = loss_fn(student, teacher, epoch=1)
    expected, n_terms = reference_loss(student, teacher, center0, ncrops, 0.1, 0.04 + 0.03 / 2)
    assert n_terms == 2 * ncrops - 2
    torch.testing.assert_close(out.loss, expected)
    # centre: 0.9 * old + 0.1 * mean teacher logit of the batch
    torch.testing.assert_close(loss_fn.center, 0.9 * center0 + 0.1 * teacher.mean(0, keepdim=True))


def test_no_center_update_when_disabled_and_center_is_a_buffer():
    loss_fn = DINOLoss(8)
    loss_fn(torch.randn(8, 8), torch.randn(4, 8), epoch=0, update_center=False)
    assert torch.all(loss_fn.center == 0)
    assert "center" in loss_fn.state_dict()


def test_collapse_signals_on_constructed_outputs():
    k = 16
    loss_fn = DINOLoss(k, teacher_temp=1.0, warmup_teacher_temp=1.0)
    # uniform teacher: per-sample entropy log K, mean distribution uniform -> KL 0
    out = loss_fn(torch.zeros(8, k), torch.zeros(4, k), epoch=0, update_center=False)
    assert out.teacher_entropy == pytest.approx(math.log(k), rel=1e-5)
    assert out.kl_to_uniform == pytest.approx(0.0, abs=1e-5)
    # every sample one-hot on the same prototype: entropy 0, KL log K
    teacher = torch.full((4, k), -1e4)
    teacher[:, 3] = 1e4
    out = loss_fn(torch.zeros(8, k), teacher, epoch=0, update_center=False)
    assert out.teacher_entropy == pytest.approx(0.0, abs=1e-5)
    assert out.kl_to_uniform == pytest.approx(math.log(k), rel=1e-5)


def test_loss_gradient_flows_to_student_only():
    student = torch.randn(8, 8, requires_grad=True)
    teacher = torch.randn(4, 8, requires_grad=True)
    DINOLoss(8)(student, teacher, epoch=0).loss.backward()
    assert student.grad is not None and teacher.grad is None


def test_loss_rejects_inconsistent_batches():
    with pytest.raises(ValueError, match="multiple"):
        DINOLoss(8)(torch.randn(7, 8), torch.randn(4, 8), epoch=0)
