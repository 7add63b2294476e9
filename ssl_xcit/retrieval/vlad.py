"""k-means codebooks (faiss) and VLAD aggregation of local descriptors.

faiss has k-means and nearest-centroid search but no VLAD, so the aggregation is written here (Jegou et al.,
TPAMI'12; Arandjelovic & Zisserman, CVPR'13): hard assignment, residual sums per visual word, signed square
root, intra-normalisation per word, then a global L2.
"""

from __future__ import annotations

import warnings

import faiss
import numpy as np
import torch
import torch.nn.functional as F

from ssl_xcit.errors import UserError


def train_codebook(
    descriptors: np.ndarray | torch.Tensor, k: int, niter: int = 20, seed: int = 0
) -> np.ndarray:
    """k-means centroids (k, d) float32 with faiss; ``k`` larger than the descriptor count is an error."""
    x = np.ascontiguousarray(torch.as_tensor(descriptors).float().numpy())
    n, d = x.shape
    if k < 1:
        raise UserError(f"codebook size must be >= 1, got {k}")
    if k > n:
        raise UserError(
            f"codebook size k={k} is larger than the {n} training descriptors: k-means cannot place {k} "
            "centroids; add training images, raise --max-local, or lower --codebook-size"
        )
    if n < 39 * k:
        warnings.warn(
            f"k-means with k={k} on only {n} descriptors (< 39 per centroid): the codebook will be noisy",
            stacklevel=2,
        )
    # max_points_per_centroid bounds the k-means cost; faiss subsamples beyond 256 points per centroid anyway.
    kmeans = faiss.Kmeans(d, k, niter=niter, seed=seed, verbose=False, max_points_per_centroid=256)
    kmeans.train(x)
    return np.ascontiguousarray(kmeans.centroids, dtype=np.float32)


def assign(descriptors: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid (L2) of each descriptor."""
    # ||x - c||^2 = ||c||^2 - 2 x.c + const(x): one matmul, no (n, k, d) temporary.
    return ((centroids * centroids).sum(1) - 2 * descriptors @ centroids.T).argmin(1)


def vlad(
    descriptors: torch.Tensor,
    centroids: torch.Tensor,
    power: float = 0.5,
    intra_norm: bool = True,
) -> torch.Tensor:
    """VLAD vector (k * d,) of one image's descriptors (n, d) against ``centroids`` (k, d).

    ``power`` is the exponent of the signed power normalisation (0.5 = signed square root, 1 = none); words
    that receive no descriptor stay zero.
    """
    descriptors = descriptors.float()
    centroids = torch.as_tensor(centroids).float()
    k, d = centroids.shape
    if descriptors.ndim != 2 or descriptors.shape[1] != d:
        raise ValueError(
            f"descriptors must be (n, {d}) to match the codebook, got {tuple(descriptors.shape)}"
        )
    words = assign(descriptors, centroids)
    v = torch.zeros(k, d).index_add_(0, words, descriptors - centroids[words])
    if power != 1:
        v = v.sign() * v.abs().pow(power)
    if intra_norm:
        v = F.normalize(v, dim=1)
    return F.normalize(v.flatten(), dim=0)


def vlad_batch(
    descriptors: torch.Tensor,
    counts: torch.Tensor,
    centroids: torch.Tensor,
    power: float = 0.5,
    intra_norm: bool = True,
    dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """VLAD of many images whose descriptors are concatenated (``counts[i]`` rows for image i).

    Stored as float16 by default: k=1024 at 128-d is 131,072 dims, 2.6 GB for ROxford in float32; cosine
    rankings are unchanged by the 1e-3 relative rounding.
    """
    centroids = torch.as_tensor(centroids).float()
    out = torch.empty(len(counts), centroids.numel(), dtype=dtype)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.as_tensor(counts).long().cumsum(0)])
    for i in range(len(counts)):
        out[i] = vlad(descriptors[offsets[i] : offsets[i + 1]], centroids, power, intra_norm).to(dtype)
    return out
