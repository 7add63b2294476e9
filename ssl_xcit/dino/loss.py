"""The DINO loss: cross-entropy between the sharpened, centred teacher and the student, over view pairs."""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ssl_xcit.dino.precision import float32_math
from ssl_xcit.dino.schedules import teacher_temperature
from ssl_xcit.errors import UserError


class DINOLossOutput(NamedTuple):
    loss: torch.Tensor
    teacher_entropy: torch.Tensor  # mean entropy of the teacher's per-sample distribution (nats)
    kl_to_uniform: torch.Tensor  # KL(mean teacher distribution || uniform) (nats)


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


class TeacherTargets(nn.Module):
    """The teacher side shared by the DINO and iBOT terms: a temperature schedule, centring, the EMA centre.

    Args:
        out_dim: number of prototypes K of the head.
        warmup_teacher_temp: teacher temperature at epoch 0.
        teacher_temp: teacher temperature after warm-up (> 0.07 is unstable per the reference).
        warmup_teacher_temp_epochs: epochs of the linear teacher-temperature warm-up.
        student_temp: student temperature (0.1 in every published run).
        center_momentum: EMA factor of the center (0.9).
        centering: ``ema`` subtracts an EMA of the mean teacher logit before the sharpened softmax (DINO);
            ``sinkhorn_knopp`` turns the sharpened teacher logits into targets whose prototypes share the batch
            equally (DINOv2's centring, 3 iterations): neither collapse mode can form within a batch, which
            is what small batches on small data need.
        sinkhorn_iterations: Sinkhorn-Knopp normalisation rounds (3 in DINOv2).
    """

    def __init__(
        self,
        out_dim: int,
        warmup_teacher_temp: float = 0.04,
        teacher_temp: float = 0.04,
        warmup_teacher_temp_epochs: int = 0,
        student_temp: float = 0.1,
        center_momentum: float = 0.9,
        centering: Literal["ema", "sinkhorn_knopp"] = "ema",
        sinkhorn_iterations: int = 3,
    ) -> None:
        super().__init__()
        if centering not in ("ema", "sinkhorn_knopp"):
            raise UserError(f"centering must be 'ema' or 'sinkhorn_knopp', got {centering!r}")
        if sinkhorn_iterations < 1:
            raise UserError(f"sinkhorn_iterations must be >= 1, got {sinkhorn_iterations}")
        self.centering = centering
        self.sinkhorn_iterations = sinkhorn_iterations
        self.out_dim = out_dim
        self.warmup_teacher_temp = warmup_teacher_temp
        self.teacher_temp = teacher_temp
        self.warmup_teacher_temp_epochs = warmup_teacher_temp_epochs
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        # A buffer, so it is saved in (and restored from) checkpoints and moved with the module.
        self.register_buffer("center", torch.zeros(1, out_dim))
        # Set by a caller that steps the centre itself (DINO, once per optimiser step: ``apply_center``).
        self.defer_center = False
        # (sum of the teacher rows, their count) since the centre last moved, float32 on the device.
        self._window: tuple[torch.Tensor, torch.Tensor] | None = None

    def teacher_temp_at(self, epoch: int) -> float:
        return teacher_temperature(
            epoch, self.warmup_teacher_temp, self.teacher_temp, self.warmup_teacher_temp_epochs
        )

    def targets(self, teacher_output: torch.Tensor, epoch: int) -> torch.Tensor:
        """The teacher's (detached) target distributions for logits (N, K): centred and sharpened."""
        temp = self.teacher_temp_at(epoch)
        if self.centering == "sinkhorn_knopp":
            return sinkhorn_knopp(teacher_output.detach() / temp, self.sinkhorn_iterations, inplace=True)
        return F.softmax((teacher_output - self.center) / temp, dim=-1).detach()

    @torch.no_grad()
    def collapse_signals(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean per-row entropy, KL(mean target || uniform)) in nats; zeros without rows."""
        if targets.shape[0] == 0:
            zero = targets.new_zeros(())
            return zero, zero
        entropy = -(targets * torch.log(targets.clamp_min(1e-12))).sum(-1).mean()
        mean_probs = targets.mean(0)
        kl_uniform = (mean_probs * torch.log(mean_probs.clamp_min(1e-12))).sum() + math.log(self.out_dim)
        return entropy, kl_uniform

    @torch.no_grad()
    def update_center(self, teacher_output: torch.Tensor) -> None:
        """Adds the teacher rows to the window of the centre's next move, and makes that move now (an EMA step
        towards the window's mean row over all processes) unless ``defer_center``."""
        rows = teacher_output.detach().float()
        # torch.full, not torch.tensor([...], device=...): a fill kernel is queued, a host-to-device copy of a
        # Python list waits for the GPU queue to drain. dtype given: a fill takes the default dtype, which a
        # precision plugin may have made a half one.
        count = torch.full((1,), float(rows.shape[0]), device=rows.device, dtype=torch.float32)
        row_sum = rows.sum(dim=0, keepdim=True)
        if self._window is None:
            self._window = (row_sum, count)
        else:
            self._window[0].add_(row_sum)
            self._window[1].add_(count)
        if not self.defer_center:
            self.apply_center()

    @torch.no_grad()
    def apply_center(self) -> None:
        """One EMA step of the centre towards the mean teacher row of the window (every batch since the last
        step, all processes), so k accumulated micro-batches move it as one step over their concatenation does.
        Nothing without a window; the processes agree on that (they skip batches together)."""
        if self._window is None:
            return
        row_sum, count = self._window
        self._window = None
        ema_center_from_sums_(self.center, row_sum, count, self.center_momentum)


class DINOLoss(TeacherTargets):
    """Self-distillation loss with centering and teacher sharpening.

    Args: those of :class:`TeacherTargets`, plus ``num_global_crops``: the teacher sees only the first
    ``num_global_crops`` views.

    Collapse signals: with centering dominating, every teacher output becomes uniform (entropy -> log K,
    KL-to-uniform -> 0); with sharpening dominating, one prototype wins for every image (entropy -> 0,
    KL-to-uniform -> log K). Healthy training keeps per-sample entropy low and KL-to-uniform low as well.
    """

    def __init__(self, out_dim: int, num_global_crops: int = 2, **teacher_targets: Any) -> None:
        super().__init__(out_dim, **teacher_targets)
        self.num_global_crops = num_global_crops

    def forward(
        self,
        student_output: torch.Tensor,
        teacher_output: torch.Tensor,
        epoch: int,
        update_center: bool = True,
        local_weight: float = 1.0,
    ) -> DINOLossOutput:
        """``student_output``: (V*B, K) logits of all V views, view-major; ``teacher_output``: (G*B, K)
        logits of the G global views. Pairs where student and teacher see the same view are skipped.

        ``local_weight`` scales the pairs of a local (student) view, and the sum is still divided by the count
        of all pairs, as DINOv3's ``compute_losses`` (``dinov3/train/ssl_meta_arch.py``): its global and local
        terms are means weighted by their shares of the pairs, the local one times the weight. 1: DINO's mean."""
        n_global = self.num_global_crops
        if teacher_output.shape[0] % n_global:
            raise ValueError(
                f"teacher batch {teacher_output.shape[0]} is not a multiple of {n_global} global crops"
            )
        batch = teacher_output.shape[0] // n_global
        if student_output.shape[0] % batch:
            raise ValueError(
                f"student batch {student_output.shape[0]} is not a multiple of the per-view batch {batch}"
            )
        n_views = student_output.shape[0] // batch

        with float32_math(student_output.device):
            return self._loss(
                student_output.float(), teacher_output.float(), n_views, epoch, update_center, local_weight
            )

    def _loss(
        self,
        student_output: torch.Tensor,
        teacher_output: torch.Tensor,
        n_views: int,
        epoch: int,
        update: bool,
        local_weight: float = 1.0,
    ) -> DINOLossOutput:
        # Float32 with autocast off (``forward``), as DINOv2: log-softmax over 65536 prototypes in half
        # precision loses the tail, and autocast would run any product written here in half precision.
        n_global = self.num_global_crops
        student_logp = F.log_softmax(student_output / self.student_temp, dim=-1).chunk(n_views)
        teacher_probs = self.targets(teacher_output, epoch)

        total = student_output.new_zeros(())
        n_terms = 0
        for iq, q in enumerate(teacher_probs.chunk(n_global)):
            for v in range(n_views):
                if v == iq:
                    continue  # same view for teacher and student
                term = torch.sum(-q * student_logp[v], dim=-1).mean()
                # A host float: the default weight 1 adds the term as DINO's loop does (no extra product).
                total = total + (term if v < n_global or local_weight == 1.0 else local_weight * term)
                n_terms += 1
        loss = total / n_terms

        entropy, kl_uniform = self.collapse_signals(teacher_probs)
        if update and self.centering == "ema":
            self.update_center(teacher_output)
        return DINOLossOutput(loss, entropy, kl_uniform)


@torch.no_grad()
def ema_center_from_sums_(
    center: torch.Tensor, row_sum: torch.Tensor, count: torch.Tensor, momentum: float
) -> None:
    """``center`` <- momentum * center + (1 - momentum) * (``row_sum`` / ``count``), both summed over all
    processes first (in place: the caller's window is spent)."""
    if _dist_ready():
        # Sum the counts too, so ranks with unequal last batches still give the exact global mean.
        dist.all_reduce(row_sum)
        dist.all_reduce(count)
    updated = center * momentum + (row_sum / count.clamp_min(1)) * (1 - momentum)
    # torch.where, not an `if` on the count: no host sync per step on an accelerator.
    center.copy_(torch.where(count > 0, updated, center))


def _sum64(q: torch.Tensor, dim: int, chunk_elements: int = 2**23) -> torch.Tensor:
    """``q.sum(dim, dtype=float64)`` over row chunks: a reduction to float64 first casts its whole input (one
    float64 copy of q), so a chunk of at most ``chunk_elements`` is cast at a time."""
    rows = max(1, chunk_elements // max(q.shape[1], 1))
    parts = [chunk.sum(dim=dim, dtype=torch.float64) for chunk in q.split(rows)]
    if dim == 1:
        return torch.cat(parts) if parts else q.new_zeros(0, dtype=torch.float64)
    total = parts[0] if parts else q.new_zeros(q.shape[1], dtype=torch.float64)
    for part in parts[1:]:
        total += part
    return total


@torch.no_grad()
def sinkhorn_knopp(scores: torch.Tensor, iterations: int = 3, inplace: bool = False) -> torch.Tensor:
    """Targets (B, K) from teacher scores (B, K) = logits / temperature, by Sinkhorn-Knopp on exp(scores).

    Alternately scales prototypes to an equal share 1/K of the (global) batch and samples to an equal share
    1/B, ending on samples, so each row is a distribution over the K prototypes. Under DDP the prototype
    maxima and sums and the batch size are all-reduced, so the equipartition holds over the global batch.
    ``inplace`` reuses a float32 ``scores`` as the work buffer (the caller's temporary).

    Memory: one float32 (B, K) buffer, worked in place; float64 only for the (K,) and (B,) sums, cast a chunk
    at a time. At DINOv2's masked patches (~3.7k x 65,536): 85 MB above its input, where the float64 algorithm
    this replaced took 6.5 GB (``benchmarks/bench_sinkhorn.py``, CPU).
    """
    out_dtype = scores.dtype if scores.dtype.is_floating_point else torch.float32
    q = scores if inplace and scores.dtype == torch.float32 else scores.to(torch.float32, copy=True)
    b, k = q.shape
    # Each prototype's maximum over the global batch is subtracted before exp(). Scaling a prototype is
    # undone exactly by its first normalisation, so this changes no target, and every prototype keeps an
    # entry of 1: with one global maximum, a prototype far below it (a spread of 2 / 0.01 on cosine logits)
    # would underflow float32 to an all-zero row. A process with no rows joins with neutral values.
    peak = q.amax(dim=0) if b else q.new_full((k,), -torch.inf)
    if _dist_ready():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    q.sub_(peak.clamp_min(torch.finfo(q.dtype).min)).exp_()
    batch = torch.full((1,), float(b), device=q.device, dtype=torch.float64)
    if _dist_ready():
        dist.all_reduce(batch)
    tiny = torch.finfo(torch.float64).tiny
    for _ in range(iterations):
        per_prototype = _sum64(q, dim=0)  # (K,)
        if _dist_ready():
            dist.all_reduce(per_prototype)
        q.div_((per_prototype.clamp_min(tiny) * k).to(q.dtype))
        per_sample = _sum64(q, dim=1).unsqueeze(1)  # (B, 1)
        # The old global normalisation by the total is skipped: the prototype step rescales every row anyway.
        q.div_((per_sample.clamp_min(tiny) * batch).to(q.dtype))
    q.mul_(batch.to(q.dtype))
    return q if out_dtype == torch.float32 else q.to(out_dtype)
