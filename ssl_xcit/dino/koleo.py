"""KoLeo regulariser (Kozachenko-Leonenko entropy estimator, as used by DINOv2 on the student's CLS embedding).

On small data a freshly initialised backbone maps every image to nearly the same direction; DINO's centring then
turns the teacher uniform (the collapse the guard reports). KoLeo pushes each embedding away from its nearest
neighbour in the batch, ``-mean_i log(min_j ||x_i - x_j||)`` on L2-normalised rows, which spreads the batch over
the sphere and gives the teacher per-image differences to sharpen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssl_xcit.dino.precision import float32_math


def nearest_neighbours(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's nearest other row of ``x`` (B, D), rows of unit norm: the largest dot product.

    The similarities of a near-collapsed batch are all within ~1e-4 of 1. Under bf16 autocast (a step of 2^-8
    there) or TF32 matmuls (``torch.set_float32_matmul_precision("high")``, 2^-11) they would tie and most
    neighbours would be picked at random, so this B x B product runs in float64 with autocast off (float32 on
    MPS, which has no float64): exact under every precision, and B^2 D is small beside the step.
    """
    wide = torch.float32 if x.device.type == "mps" else torch.float64
    with torch.no_grad(), float32_math(x.device):
        rows = x.to(wide)
        sim = rows @ rows.T
        sim.fill_diagonal_(-2.0)
        return sim.argmax(dim=1)


def koleo_loss(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """KoLeo loss of a batch of embeddings ``x`` (B, D), B >= 2: mean over rows of -log(distance to the
    nearest other row), after L2 normalisation. ``eps`` keeps duplicate rows finite. Float32 whatever the
    autocast (DINOv2 turns it off here too): exact neighbours and distances under every precision."""
    if x.dim() != 2 or x.shape[0] < 2:
        raise ValueError(f"koleo_loss needs a (batch >= 2, dim) tensor, got shape {tuple(x.shape)}")
    with float32_math(x.device):
        x = F.normalize(x.float(), dim=-1, eps=eps)
        # The gradient flows only through the distance to the nearest neighbour, as in the estimator.
        distance = F.pairwise_distance(x, x[nearest_neighbours(x)], p=2, eps=eps)
        return -torch.log(distance + eps).mean()
