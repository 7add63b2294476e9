"""KoLeo regulariser against a brute-force computation, on a constructed case, and inside the DINO step."""

from __future__ import annotations

import math

import lightning as L
import numpy as np
import pytest
import torch

from ssl_xcit.dino.koleo import koleo_loss, nearest_neighbours


def reference_koleo(x: np.ndarray) -> float:
    """Double loop in float64: -mean_i log(min_{j != i} ||x_i/|x_i| - x_j/|x_j|||)."""
    x = x.astype(np.float64)
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    logs = []
    for i in range(len(x)):
        nearest = min(np.linalg.norm(x[i] - x[j]) for j in range(len(x)) if j != i)
        logs.append(math.log(nearest))
    return -float(np.mean(logs))


def test_koleo_matches_brute_force():
    x = torch.randn(17, 9, generator=torch.Generator().manual_seed(0)) * 3
    assert koleo_loss(x).item() == pytest.approx(reference_koleo(x.numpy()), rel=1e-5)


def test_koleo_on_a_square():
    # Four unit vectors at 90 degrees (scaled, to check the normalisation): every nearest distance is sqrt(2).
    x = torch.tensor([[2.0, 0.0], [0.0, 5.0], [-1.0, 0.0], [0.0, -0.5]])
    assert koleo_loss(x).item() == pytest.approx(-math.log(math.sqrt(2.0)), abs=1e-6)


def test_koleo_gradient_spreads_a_tight_batch():
    x = (
        torch.ones(8, 4) + 0.05 * torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    ).requires_grad_()
    before = koleo_loss(x)
    before.backward()
    with torch.no_grad():
        after = koleo_loss(x - 0.5 * x.grad)
    assert after < before - 0.1  # a descent step moves nearest neighbours apart


def test_koleo_is_exact_under_bf16_autocast():
    """A near-collapsed batch (every cosine above 0.999, the regime KoLeo exists for): under bf16 autocast the
    similarities would round to steps of 2^-9 near 1 and tie, and most neighbours change (the loss moved from
    4.28 to 4.15 in the issue). Autocast is off inside: the neighbours are those of the float64 similarities
    of the normalised rows, and the loss is float32's and a float64 brute force's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 384, generator=g) + 0.01 * torch.randn(64, 384, generator=g)
    unit = torch.nn.functional.normalize(x, dim=1).double()
    expected = (unit @ unit.T).fill_diagonal_(-2.0).argmax(dim=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        nearest = nearest_neighbours(torch.nn.functional.normalize(x, dim=1))
        loss = koleo_loss(x)
    assert torch.equal(nearest, expected)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(koleo_loss(x).item(), rel=1e-6)
    assert loss.item() == pytest.approx(reference_koleo(x.numpy()), rel=1e-5)


def test_koleo_rejects_a_single_row():
    with pytest.raises(ValueError, match=r"batch >= 2.*\(1, 4\)"):
        koleo_loss(torch.ones(1, 4))


def test_dino_step_adds_weighted_koleo_of_student_global_embeddings(tiny, tmp_path):
    """First-step loss with koleo_weight w minus the one without = w * sum over the 2 global crops of KoLeo of
    the student backbone's embeddings (no drop path, so both runs see the same student)."""
    expected = None
    losses = {}
    batch = next(iter(tiny.loader(n=8, batch_size=8, shuffle=False, noise=False)))
    for weight in (0.0, 0.3):
        L.seed_everything(0)
        model = tiny.model(drop_path_rate=0.0, koleo_weight=weight)
        if weight:
            with torch.no_grad():
                # One backbone call on both global crops, as the step makes (BatchNorm sees both).
                embedding = model.student.backbone(torch.cat(batch[0][:2]))
                expected = sum(koleo_loss(view) for view in embedding.chunk(2))
        trainer = tiny.trainer(tmp_path / str(weight), max_epochs=1, limit_train_batches=1)
        rec = tiny.Recorder()
        trainer.callbacks.append(rec)
        trainer.fit(model, tiny.loader(n=8, batch_size=8, shuffle=False, noise=False))
        losses[weight] = rec.losses[0]
    assert losses[0.3] - losses[0.0] == pytest.approx(0.3 * float(expected), rel=1e-4, abs=1e-5)


def test_negative_koleo_weight_is_named(tiny):
    with pytest.raises(ValueError, match="koleo_weight must be >= 0.*-0.1"):
        tiny.model(koleo_weight=-0.1)
