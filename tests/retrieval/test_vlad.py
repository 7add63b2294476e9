"""VLAD aggregation, the faiss codebook and the PCA(-whitening) of local descriptors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ssl_xcit.retrieval.pca import PCA
from ssl_xcit.retrieval.vlad import assign, train_codebook, vlad, vlad_batch


def test_vlad_exact_value_on_tiny_case():
    centroids = torch.tensor([[0.0, 0.0], [10.0, 0.0]])
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [11.0, 1.0]])
    # Residual sums: word 0 <- (1, 0) + (0, 2) = (1, 2); word 1 <- (1, 1).
    plain = vlad(x, centroids, power=1.0, intra_norm=False)
    assert torch.allclose(plain, torch.tensor([1.0, 2.0, 1.0, 1.0]) / math.sqrt(7))
    # Signed sqrt -> (1, sqrt2), (1, 1); intra-norm -> (1, sqrt2)/sqrt3, (1, 1)/sqrt2; global L2 -> / sqrt2.
    full = vlad(x, centroids, power=0.5, intra_norm=True)
    expected = torch.tensor([1 / math.sqrt(6), 1 / math.sqrt(3), 0.5, 0.5])
    assert torch.allclose(full, expected, atol=1e-6)


def test_vlad_signed_power_keeps_sign():
    centroids = torch.tensor([[0.0, 0.0]])
    out = vlad(torch.tensor([[-4.0, 1.0]]), centroids, power=0.5, intra_norm=False)
    assert torch.allclose(out, torch.tensor([-2.0, 1.0]) / math.sqrt(5))


def test_vlad_shape_and_norms():
    g = torch.Generator().manual_seed(0)
    k, d = 8, 16
    centroids = torch.randn(k, d, generator=g)
    # Descriptors near centroids 0..4 only: words 5..7 receive nothing and must stay exactly zero.
    x = centroids[torch.arange(40) % 5] + 0.1 * torch.randn(40, d, generator=g)
    v = vlad(x, centroids)
    assert v.shape == (k * d,)
    assert v.norm() == pytest.approx(1.0, abs=1e-6)
    blocks = v.view(k, d).norm(dim=1)
    assert torch.all(blocks[5:] == 0)
    # Intra-normalisation makes every non-empty block the same norm before the global L2.
    assert torch.allclose(blocks[:5], torch.full((5,), 1 / math.sqrt(5)), atol=1e-6)


def test_vlad_batch_matches_per_image_and_is_float16():
    g = torch.Generator().manual_seed(1)
    centroids = torch.randn(4, 8, generator=g)
    x = torch.randn(30, 8, generator=g)
    counts = torch.tensor([10, 5, 15])
    out = vlad_batch(x, counts, centroids)
    assert out.dtype == torch.float16 and out.shape == (3, 32)
    assert torch.allclose(out[1].float(), vlad(x[10:15], centroids), atol=1e-3)


def test_assign_matches_bruteforce():
    g = torch.Generator().manual_seed(2)
    c, x = torch.randn(7, 5, generator=g), torch.randn(50, 5, generator=g)
    assert torch.equal(assign(x, c), torch.cdist(x, c).argmin(1))


def test_codebook_recovers_separated_clusters():
    rng = np.random.default_rng(0)
    centres = np.array([[0, 0], [10, 0], [0, 10]], dtype=np.float32)
    x = np.concatenate([c + 0.1 * rng.standard_normal((100, 2)) for c in centres]).astype(np.float32)
    found = train_codebook(x, 3, seed=0)
    assert found.shape == (3, 2) and found.dtype == np.float32
    dist = np.linalg.norm(found[:, None] - centres[None], axis=2).min(axis=0)
    assert np.all(dist < 0.1)


def test_codebook_larger_than_descriptor_count_is_a_clear_error():
    with pytest.raises(ValueError, match=r"k=50 .* 20 training descriptors"):
        train_codebook(np.zeros((20, 4), dtype=np.float32), 50)


def test_pca_projects_onto_principal_axes_and_whitens():
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([10.0, 3.0, 1.0, 0.1])
    x = torch.randn(5000, 4, generator=g) * scales + 5
    pca = PCA.fit(x, 2)
    # The top two axes are the first two coordinates (up to sign).
    assert torch.allclose(pca.components.abs(), torch.eye(4)[:2], atol=0.02)
    assert torch.allclose(pca.eigenvalues, scales[:2] ** 2, rtol=0.1)
    y = pca(x)
    assert y.shape == (5000, 2) and torch.allclose(y.norm(dim=1), torch.ones(5000), atol=1e-5)
    white = PCA.fit(x, 4, whiten_power=0.5)
    z = ((x - white.mean) @ white.components.T) * white.eigenvalues.rsqrt()
    assert torch.allclose(torch.cov(z.T), torch.eye(4), atol=0.05)
    restored = PCA.from_state_dict(white.state_dict())
    assert torch.allclose(restored(x[:10]), white(x[:10]))


def test_pca_errors_name_the_numbers():
    with pytest.raises(ValueError, match="more than 8 training vectors, got 5"):
        PCA.fit(torch.randn(5, 16), 8)
    with pytest.raises(ValueError, match="32 dimensions is impossible for 16-dimensional"):
        PCA.fit(torch.randn(100, 16), 32)


@pytest.mark.parametrize("whiten_power", [0.0, 0.25, 0.5])
def test_pca_agrees_with_faiss_pca_matrix(whiten_power):
    """faiss.PCAMatrix(eigen_power=-p, epsilon) is the same map; outputs agree up to per-axis sign."""
    import faiss

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, 24, generator=g) * torch.logspace(0, -3, 24) + 0.5  # decaying spectrum, offset mean
    ours = PCA.fit(x, 8, whiten_power=whiten_power)
    reference = faiss.PCAMatrix(24, 8, -whiten_power)
    reference.train(x.numpy())
    # Our floor is relative to the largest eigenvalue; give faiss the same absolute value, then rebuild its map.
    top = faiss.vector_to_array(reference.eigenvalues).max()
    reference.epsilon = float(ours.eps * top)
    reference.prepare_Ab()
    y = ours(x[:200])
    z = torch.nn.functional.normalize(torch.from_numpy(reference.apply(x[:200].numpy())), dim=-1)
    # Eigenvector signs are arbitrary, so compare what they cannot change: the cosine similarities.
    torch.testing.assert_close(y @ y.T, z @ z.T, atol=2e-4, rtol=0)


def _hand_written_pca(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The computation PCA.fit did by hand before it used scikit-learn: float64 covariance, eigh, sorted."""
    mean = x.double().mean(0)
    xc = x.double() - mean
    eigenvalues, vectors = torch.linalg.eigh(xc.T @ xc / (x.shape[0] - 1))
    order = torch.argsort(eigenvalues, descending=True)[:dim]
    return mean.float(), vectors[:, order].T.float(), eigenvalues[order].clamp_min(0).float()


@pytest.mark.parametrize("whiten_power", [0.0, 0.25, 0.5])
def test_pca_equals_the_hand_written_computation_it_replaced(whiten_power):
    g = torch.Generator().manual_seed(1)
    x = (
        torch.randn(5000, 32, generator=g) * torch.logspace(0, -2.5, 32) + 0.3
    )  # decaying spectrum, offset mean
    mean, components, eigenvalues = _hand_written_pca(x, 12)
    fitted = PCA.fit(x, 12, whiten_power=whiten_power)
    torch.testing.assert_close(fitted.mean, mean, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(fitted.eigenvalues, eigenvalues, rtol=1e-5, atol=0)
    # Eigenvectors are defined up to sign: scikit-learn fixes it, eigh does not.
    signs = torch.sign((fitted.components * components).sum(1, keepdim=True))
    torch.testing.assert_close(fitted.components, signs * components, rtol=0, atol=1e-5)
    reference = PCA(mean, signs * components, eigenvalues, whiten_power=whiten_power)
    torch.testing.assert_close(fitted(x[:300]), reference(x[:300]), rtol=0, atol=1e-5)
