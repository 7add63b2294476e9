"""KoLeo regulariser (Kozachenko-Leonenko entropy estimator, as used by DINOv2 on the student's CLS embedding).

On small data a freshly initialised backbone maps every image to nearly the same direction; DINO's centring then
turns the teacher uniform (the collapse the guard reports). KoLeo pushes each embedding away from its nearest
neighbour in the batch, ``-mean_i log(min_j ||x_i - x_j||)`` on L2-normalised rows, which spreads the batch over
the sphere and gives the teacher per-image differences to sharpen.

:func:`koleo_loss` spreads each rank's batch on its own (DINOv2's ``KoLeoLoss``); :func:`grouped_koleo_loss` is
DINOv3's distributed variant, over groups of the global batch (its high-resolution stage: groups of 16).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from ssl_xcit.dino.precision import float32_math
from ssl_xcit.parallel.step_checks import host_group


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


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def grouped_koleo_loss(x: torch.Tensor, group_size: int, eps: float = 1e-8) -> torch.Tensor:
    """DINOv3's distributed KoLeo (``dinov3/loss/koleo_loss.py``, ``KoLeoLossDistributed`` with ``topk`` 1) of
    this rank's embeddings ``x`` (B, D): the global batch (every rank's rows, in rank order) is cut into groups
    of ``group_size`` consecutive rows, and each row's nearest neighbour is sought in its own group only; the
    result is the mean over this rank's rows of -log(distance + eps), after L2 normalisation.

    A group larger than a rank's batch spans ranks: the rows are then gathered with a differentiable
    all-gather, so the gradient reaches the neighbour's rank too, as in DINOv3. Every rank must call this at the same point.
    Where DINOv3 fails: ranks whose batches differ (unreadable files dropped) keep their slots of the largest
    batch (the sizes are agreed on the host), a group need not divide the batch, and a row whose group holds no
    other row is left out of the mean (0 when no row has a neighbour)."""
    if x.dim() != 2:
        raise ValueError(f"grouped_koleo_loss needs a (batch, dim) tensor, got shape {tuple(x.shape)}")
    if group_size < 2:
        raise ValueError(f"grouped_koleo_loss needs groups of >= 2 rows, got group_size={group_size}")
    world, rank = _world()
    if world > 1:
        sizes = torch.zeros(world, dtype=torch.int64)
        sizes[rank] = x.shape[0]
        dist.all_reduce(sizes, group=host_group())  # CPU tensors on the host group: the device never waits
        sizes = sizes.tolist()
    else:
        sizes = [x.shape[0]]
    slots = max(sizes)  # each rank's rows start at rank x slots of the global batch
    spans = world > 1 and slots % group_size != 0  # some group holds rows of several ranks: gather
    # Host facts: which candidate slots hold a row, and the group of each (all ranks' slots, or this rank's rows).
    if spans:
        candidate = [(r, i) for r in range(world) for i in range(slots)]
    else:
        candidate = [(rank, i) for i in range(x.shape[0])]
    valid = torch.tensor([i < sizes[r] for r, i in candidate])
    cand_group = torch.tensor([(r * slots + i) // group_size for r, i in candidate])
    own = torch.arange(x.shape[0]) + rank * slots
    allowed = (cand_group[None, :] == (own // group_size)[:, None]) & valid[None, :]
    self_col = own - (0 if spans else rank * slots)
    allowed[torch.arange(x.shape[0]), self_col] = False
    keep = allowed.any(dim=1)
    with float32_math(x.device):
        x = F.normalize(x.float(), dim=-1, eps=eps)
        if spans:
            padded = F.pad(x, (0, 0, 0, slots - x.shape[0]))
            # Differentiable (its backward is a reduce-scatter, which gloo runs too); torch's functional
            # collective, as torch.distributed.nn's all_gather is deprecated.
            candidates = funcol.wait_tensor(funcol.all_gather_single_autograd(padded, 0, dist.group.WORLD))
        else:
            candidates = x
        wide = torch.float32 if x.device.type == "mps" else torch.float64
        with torch.no_grad():  # exact neighbours under every precision, as nearest_neighbours
            sim = x.detach().to(wide) @ candidates.detach().to(wide).T
            sim.masked_fill_(~allowed.to(x.device, non_blocking=True), -3.0)
            nearest = sim.argmax(dim=1)
        distance = F.pairwise_distance(x, candidates[nearest], p=2, eps=eps)
        weight = keep.to(x.device, dtype=torch.float32, non_blocking=True)
        return -(torch.log(distance + eps) * weight).sum() / max(int(keep.sum()), 1)
