"""Sinkhorn-Knopp centring (DINOv2) against an independent float64 computation, and inside the DINO loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ssl_xcit.dino.loss import DINOLoss, sinkhorn_knopp


def reference_sinkhorn(scores: np.ndarray, iterations: int) -> np.ndarray:
    """Scaling-vector form: P = exp(scores), targets = diag(a) P diag(b) with the prototype (column) scaling
    and the sample (row) scaling updated alternately, rows finally summing to 1."""
    p = np.exp(scores.astype(np.float64))
    n, k = p.shape
    a = np.full(n, 1.0 / p.sum())  # row scaling
    b = np.ones(k)  # column scaling
    for _ in range(iterations):
        cols = (a[:, None] * p * b[None, :]).sum(0)
        b = b / (cols * k)
        rows = (a[:, None] * p * b[None, :]).sum(1)
        a = a / (rows * n)
    return n * a[:, None] * p * b[None, :]


@pytest.mark.parametrize("iterations", [1, 3, 10])
def test_sinkhorn_matches_independent_computation(iterations):
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(12, 7, generator=g) * 3
    ours = sinkhorn_knopp(scores, iterations).double().numpy()
    ref = reference_sinkhorn(scores.numpy(), iterations)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ours.sum(1), np.ones(12), rtol=1e-5)  # each row is a distribution


def test_sinkhorn_equipartitions_a_collapsed_teacher():
    """Every sample prefers prototype 0 (one-prototype collapse under softmax); Sinkhorn spreads the batch."""
    scores = torch.zeros(64, 8)
    scores[:, 0] = 5.0
    scores += 0.5 * torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    softmax_share = torch.softmax(scores, dim=1).mean(0)
    sk_share = sinkhorn_knopp(scores, 20).mean(0)
    assert softmax_share[0] > 0.9
    torch.testing.assert_close(sk_share, torch.full((8,), 1 / 8), atol=2e-3, rtol=0)


def test_sinkhorn_is_finite_for_very_sharp_scores():
    # cosine logits span [-1, 1]; at temperature 0.01 that is a spread of 200 in the exponent
    scores = (torch.rand(16, 32, generator=torch.Generator().manual_seed(2)) * 2 - 1) / 0.01
    targets = sinkhorn_knopp(scores)
    assert torch.isfinite(targets).all() and targets.dtype == torch.float32
    torch.testing.assert_close(targets.sum(1), torch.ones(16))


def test_loss_with_sinkhorn_uses_sk_targets_and_leaves_centre_alone():
    g = torch.Generator().manual_seed(3)
    batch, k, views = 4, 10, 4
    student = torch.randn(views * batch, k, generator=g)
    teacher = torch.randn(2 * batch, k, generator=g)
    loss_fn = DINOLoss(k, warmup_teacher_temp=0.05, teacher_temp=0.05, centering="sinkhorn_knopp")
    out = loss_fn(student, teacher, epoch=0)
    targets = torch.from_numpy(reference_sinkhorn((teacher / 0.05).numpy(), 3)).float().chunk(2)
    logp = torch.log_softmax(student / 0.1, dim=1).chunk(views)
    terms = [(-targets[t] * logp[v]).sum(1).mean() for t in range(2) for v in range(views) if v != t]
    assert float(out.loss) == pytest.approx(float(sum(terms) / len(terms)), rel=1e-5)
    assert torch.count_nonzero(loss_fn.center) == 0


def test_unknown_centering_is_named():
    with pytest.raises(ValueError, match="centering must be 'ema' or 'sinkhorn_knopp', got 'sinkhorn'"):
        DINOLoss(8, centering="sinkhorn")


def test_sinkhorn_in_float32_keeps_a_prototype_far_below_the_peak():
    """Each prototype's own maximum is subtracted (exact: the first normalisation undoes any per-prototype
    scale). With one global maximum a prototype 150 below it underflows float32 to an all-zero row and gets no
    share; the float64 reference gives it its 1/K."""
    g = torch.Generator().manual_seed(4)
    scores = torch.randn(12, 7, generator=g) * 3
    scores[:, 5] -= 150.0
    ours = sinkhorn_knopp(scores, 3)
    assert ours.dtype == torch.float32 and torch.isfinite(ours).all()
    ref = reference_sinkhorn(scores.numpy(), 3)
    np.testing.assert_allclose(ours.double().numpy(), ref, rtol=1e-5, atol=1e-7)
    assert ours[:, 5].sum() > 1.0  # about its 12 / 7 after 3 rounds, where a zero row would give it 0


def test_sinkhorn_inplace_works_in_the_callers_buffer():
    scores = torch.randn(6, 5, generator=torch.Generator().manual_seed(5))
    expected = sinkhorn_knopp(scores.clone())
    out = sinkhorn_knopp(scores, inplace=True)
    assert out.data_ptr() == scores.data_ptr()  # no (B, K) copy
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def _view_major_concat(a: torch.Tensor, b: torch.Tensor, views: int) -> torch.Tensor:
    """The rows of two view-major micro-batches as one view-major batch (each view: a's images, then b's)."""
    return torch.cat([torch.cat(pair) for pair in zip(a.chunk(views), b.chunk(views), strict=True)])


def test_deferred_centre_moves_once_as_one_step_over_the_concatenated_batch():
    """Two micro-batches with ``defer_center`` (what DINO does under accumulation): both see the old centre, and
    ``apply_center`` moves it once, to where one step over the concatenated batch moves it (DINO term's and,
    through the same TeacherTargets, iBOT's centre)."""
    g = torch.Generator().manual_seed(5)
    batch, k, views = 4, 10, 4
    students = [torch.randn(views * batch, k, generator=g) for _ in range(2)]
    teachers = [torch.randn(2 * batch, k, generator=g) * 2 for _ in range(2)]
    center0 = torch.randn(1, k, generator=g)
    deferred, whole = DINOLoss(k, center_momentum=0.8), DINOLoss(k, center_momentum=0.8)
    deferred.center.copy_(center0), whole.center.copy_(center0)
    deferred.defer_center = True
    parts = []
    for student, teacher in zip(students, teachers, strict=True):
        parts.append(deferred(student, teacher, epoch=0).loss)
        assert torch.equal(deferred.center, center0)  # not moved inside the window
    deferred.apply_center()
    one = whole(_view_major_concat(*students, views), _view_major_concat(*teachers, 2), epoch=0).loss
    expected = 0.8 * center0.double() + 0.2 * torch.cat(teachers).double().mean(0, keepdim=True)
    torch.testing.assert_close(deferred.center, whole.center, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(deferred.center.double(), expected, rtol=1e-6, atol=1e-6)
    assert float(sum(parts) / 2) == pytest.approx(float(one), rel=1e-6)
    deferred.apply_center()  # an empty window: nothing moves
    torch.testing.assert_close(deferred.center, whole.center, rtol=1e-6, atol=1e-6)


def test_centre_count_is_exact_under_a_half_precision_default_dtype():
    """A precision plugin may make bfloat16 the default dtype while the loss runs: the row count (301 needs 9
    significant bits, bfloat16 has 8) must not be rounded with it."""
    loss_fn = DINOLoss(4, center_momentum=0.5)
    teacher = torch.arange(1204, dtype=torch.float32).reshape(301, 4)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        loss_fn.update_center(teacher)
    finally:
        torch.set_default_dtype(default)
    torch.testing.assert_close(loss_fn.center, 0.5 * teacher.mean(0, keepdim=True), rtol=1e-6, atol=0)
