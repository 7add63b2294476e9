"""Plans of full-depth models from traces of shallow copies: ``ssl-xcit plan --table``'s first guess.

A trace costs time in proportion to the operators it runs (a ViT-7B step: minutes on a shared 2-core CPU),
and the table needs the largest fitting batch of 8 models in 4 settings. Every term of a DINO step's memory
is a sum over the blocks plus what is outside them, per image or per step: parameters, gradients, AdamW
states and teachers grow with the depth ``d``; activations grow with ``d`` x batch ``b`` (and the stem, heads
and losses with ``b``); FSDP2's gathered unit is one block whatever ``d``. So each term, and the peak of each
phase of the step (forwards and backward; update), is ``c0 + cb b + cd d + cbd b d``: four traces, at depths
:data:`DEPTHS` and batches :data:`BATCHES`, fix it, and the plan at the model's own depth and any batch follows
by arithmetic. That holds while the same moment of the step holds the peak at every depth: without activation
checkpointing it lands within a few per cent of full traces (docs/scaling.md); with it, the peak moves between
phases as blocks are added and the fit is far off (ViT-L/16: 3x too few bytes per image), so ``--table``
settles every answer with full-depth traces (``memory_plan.max_batch``, started from this guess).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ssl_xcit.trainer.memory_plan import FRAGMENTATION, GB, MemoryPlan, PlanInput, estimate, overhead

DEPTHS = (1, 2)
BATCHES = (8, 16)
TERMS = ("parameters", "gradients", "optimizer", "teachers", "step_peak", "update_peak", "ddp_buckets")


@dataclass(frozen=True)
class Bilinear:
    """``c0 + cb b + cd d + cbd b d``."""

    c0: float
    cb: float
    cd: float
    cbd: float

    @classmethod
    def through(cls, values: dict[tuple[int, int], float]) -> Bilinear:
        """The one through four values at ``(b, d)`` for b in :data:`BATCHES`, d in :data:`DEPTHS`."""
        (b0, b1), (d0, d1) = BATCHES, DEPTHS
        slope_b = [(values[b1, d] - values[b0, d]) / (b1 - b0) for d in (d0, d1)]  # per image, at d0 and d1
        cbd = (slope_b[1] - slope_b[0]) / (d1 - d0)
        cb = slope_b[0] - cbd * d0
        at_b0 = [values[b0, d] for d in (d0, d1)]
        cd = (at_b0[1] - at_b0[0]) / (d1 - d0) - cbd * b0
        c0 = at_b0[0] - cb * b0 - cd * d0 - cbd * b0 * d0
        return cls(c0, cb, cd, cbd)

    def at(self, b: float, d: float) -> float:
        return self.c0 + self.cb * b + self.cd * d + self.cbd * b * d


def model_depth(plan: PlanInput) -> int:
    """The backbone's number of blocks as ``plan`` builds it (``backbone_kwargs.depth``, or the variant's)."""
    from ssl_xcit.models import create_model

    kwargs = dict(plan.model_args.get("backbone_kwargs") or {})
    if "depth" in kwargs:
        return int(kwargs["depth"])
    return len(
        create_model(plan.model_args.get("backbone", "xcit_small_12_p16"), device="meta", **kwargs).blocks
    )


@dataclass(frozen=True)
class DepthModel:
    """Each term of :class:`MemoryPlan` as a :class:`Bilinear` of batch and depth, and the model's depth."""

    terms: dict[str, Bilinear]
    depth: int
    plan: PlanInput

    def at(self, batch: int) -> MemoryPlan:
        """The plan at ``batch`` per GPU and the model's own depth."""
        values = {k: max(0, round(f.at(batch, self.depth))) for k, f in self.terms.items()}
        return MemoryPlan(plan=replace(self.plan, batch_size=batch), **values)

    def max_batch(self, gpu_memory_gb: float, limit: int = 4096) -> int:
        """The largest batch per GPU (up to ``limit``) that fits ``gpu_memory_gb``, 0 if none: each phase's
        peak is a line in the batch, solved for the budget."""
        budget = (gpu_memory_gb * GB - overhead(self.plan)) / (1 + FRAGMENTATION)
        best = limit
        buckets = self.terms["ddp_buckets"]
        for phase in ("step_peak", "update_peak"):
            f = self.terms[phase]
            fixed = f.c0 + f.cd * self.depth + buckets.c0 + buckets.cd * self.depth
            per_image = f.cb + f.cbd * self.depth + buckets.cb + buckets.cbd * self.depth
            if per_image <= 0:
                best = best if fixed <= budget else 0
                continue
            best = min(best, max(0, math.floor((budget - fixed) / per_image)))
        while best > 0 and not self.at(best).fits(gpu_memory_gb):  # rounding at the boundary
            best -= 1
        return best


def depth_model(plan: PlanInput) -> DepthModel:
    """Four traces of shallow copies of ``plan``'s model (:data:`DEPTHS` x :data:`BATCHES`), fitted."""
    kwargs = dict(plan.model_args.get("backbone_kwargs") or {})
    values: dict[str, dict[tuple[int, int], float]] = {k: {} for k in TERMS}
    for b in BATCHES:
        for d in DEPTHS:
            args = {**plan.model_args, "backbone_kwargs": {**kwargs, "depth": d}}
            traced = estimate(replace(plan, batch_size=b, model_args=args))
            for k in TERMS:
                values[k][b, d] = getattr(traced, k)
    return DepthModel({k: Bilinear.through(v) for k, v in values.items()}, model_depth(plan), plan)
