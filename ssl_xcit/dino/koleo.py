"""KoLeo regulariser (Kozachenko-Leonenko entropy estimator, as used by DINOv2 on the student's CLS embedding).

On small data a freshly initialised backbone maps every image to nearly the same direction; DINO's centring then
turns the teacher uniform (the collapse the guard reports). KoLeo pushes each embedding away from its nearest
neighbour in the batch, ``-mean_i log(min_j ||x_i - x_j||)`` on L2-normalised rows, which spreads the batch over
the sphere and gives the teacher per-image differences to sharpen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def koleo_loss(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """KoLeo loss of a batch of embeddings ``x`` (B, D), B >= 2: mean over rows of -log(distance to the
    nearest other row), after L2 normalisation. ``eps`` keeps duplicate rows finite."""
    if x.dim() != 2 or x.shape[0] < 2:
        raise ValueError(f"koleo_loss needs a (batch >= 2, dim) tensor, got shape {tuple(x.shape)}")
    x = F.normalize(x.float(), dim=-1, eps=eps)
    with torch.no_grad():
        # On the unit sphere the nearest neighbour is the largest dot product; the gradient flows only
        # through the distance to it, as in the estimator.
        sim = x @ x.T
        sim.fill_diagonal_(-2.0)
        nearest = sim.argmax(dim=1)
    distance = F.pairwise_distance(x, x[nearest], p=2, eps=eps)
    return -torch.log(distance + eps).mean()
