"""Per-iteration schedules, precomputed as numpy arrays like the reference ``utils.cosine_scheduler``.

Everything DINO varies during training is looked up by the global optimisation step (lr, weight decay,
teacher momentum) or by the epoch (teacher temperature), so a resumed run continues every schedule exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from ssl_xcit.errors import UserError


def cosine_schedule(
    base_value: float,
    final_value: float,
    epochs: int,
    iters_per_epoch: int,
    warmup_epochs: int = 0,
    start_warmup_value: float = 0.0,
) -> np.ndarray:
    """One value per iteration: a linear warm-up from ``start_warmup_value`` to ``base_value`` over
    ``warmup_epochs``, then a half cosine from ``base_value`` to ``final_value``.

    As in the reference, the cosine index runs over ``0 .. L-1`` for ``L`` cosine iterations, so the last value
    is slightly above ``final_value`` and the first cosine value equals the last warm-up value (``base``).
    """
    if epochs <= 0 or iters_per_epoch <= 0:
        raise ValueError(
            f"cosine_schedule needs epochs > 0 and iters_per_epoch > 0, got {epochs}, {iters_per_epoch}"
        )
    if not 0 <= warmup_epochs <= epochs:
        raise ValueError(f"warmup_epochs must be in [0, epochs={epochs}], got {warmup_epochs}")
    warmup_iters = warmup_epochs * iters_per_epoch
    warmup = np.linspace(start_warmup_value, base_value, warmup_iters) if warmup_iters > 0 else np.array([])
    iters = np.arange(epochs * iters_per_epoch - warmup_iters)
    cosine = final_value + 0.5 * (base_value - final_value) * (1 + np.cos(np.pi * iters / len(iters)))
    schedule = np.concatenate((warmup, cosine))
    assert len(schedule) == epochs * iters_per_epoch
    return schedule


def teacher_temperature(epoch: int, warmup_temp: float, final_temp: float, warmup_epochs: int) -> float:
    """Teacher temperature at ``epoch``: linear from ``warmup_temp`` to ``final_temp`` over ``warmup_epochs``
    (both ends included, as ``np.linspace`` in the reference), then constant."""
    if epoch < warmup_epochs:
        return float(np.linspace(warmup_temp, final_temp, warmup_epochs)[epoch])
    return float(final_temp)


LR_SCALING_RULES = ("linear_wrt_256", "sqrt_wrt_1024")


def scaled_lr(base_lr: float, total_batch_size: int, rule: str = "linear_wrt_256") -> float:
    """The peak lr for ``total_batch_size`` images per step: DINO's linear rule, ``base_lr`` x batch / 256
    (``base_lr`` is the peak for a batch of 256), or DINOv3's ``sqrt_wrt_1024``, ``base_lr`` x 4 x sqrt(batch /
    1024) (``dinov3/train/train.py``, ``build_schedulers_v2``; equal to the linear rule at 1024 images)."""
    if rule == "linear_wrt_256":
        return base_lr * total_batch_size / 256
    if rule == "sqrt_wrt_1024":
        return base_lr * 4 * math.sqrt(total_batch_size / 1024)
    raise UserError(f"lr_scaling_rule must be one of {', '.join(LR_SCALING_RULES)}, got {rule!r}")


class Schedules(NamedTuple):
    """DINO's per-iteration arrays and the facts they were sized from."""

    lr: np.ndarray
    weight_decay: np.ndarray
    momentum: np.ndarray
    iters_per_epoch: int
    total_batch: int
    peak_lr: float
    ibot_weight: np.ndarray | None = None  # the patch term's weight per iteration (None: iBOT off)
    gram_weight: np.ndarray | None = None  # the Gram term's weight per iteration (None: Gram anchoring off)
    local_weight: np.ndarray | None = None  # the local crops' DINO weight per iteration (None: 1 throughout)

    def local_weight_at(self, step: int) -> float:
        """The weight of the DINO term's local-crop pairs at optimiser ``step`` (its last value past the plan)."""
        if self.local_weight is None:
            return 1.0
        return float(self.local_weight[min(step, len(self.local_weight) - 1)])

    def ibot_weight_at(self, step: int) -> float:
        """The patch term's weight at optimiser ``step`` (its last value past the planned length)."""
        if self.ibot_weight is None:
            return 0.0
        return float(self.ibot_weight[min(step, len(self.ibot_weight) - 1)])

    def gram_weight_at(self, step: int) -> float:
        """The Gram term's scheduled weight at optimiser ``step`` (its last value, the full weight, past the
        planned length); the module also needs a Gram teacher held."""
        if self.gram_weight is None:
            return 0.0
        return float(self.gram_weight[min(step, len(self.gram_weight) - 1)])

    def at(self, step: int) -> tuple[float, float, float]:
        """(lr, weight decay, teacher momentum) at optimiser ``step``; a run extended past its planned length
        keeps the final values."""
        i = min(step, len(self.lr) - 1)
        return float(self.lr[i]), float(self.weight_decay[i]), float(self.momentum[i])


def dino_schedules(
    hp: Mapping[str, Any], epochs: int | None, batches: float, per_device_batch: int, world_size: int
) -> Schedules:
    """The reference's lr (linear warm-up, cosine), weight-decay and teacher-momentum schedules for a run of
    ``epochs`` x ``batches`` per epoch, from DINO's hyperparameters ``hp``. A UserError names any setting
    that leaves no valid schedule."""
    if epochs is None or epochs < 1:
        raise UserError(
            f"DINO's cosine schedules need a finite trainer.max_epochs, got {epochs}; set --trainer.max_epochs"
        )
    if not math.isfinite(batches) or batches < 1:
        raise UserError(f"DINO needs a sized training dataloader, got {batches} batches per epoch")
    accumulate = hp["accumulate_grad_batches"]
    if batches < accumulate:
        raise UserError(
            f"accumulate_grad_batches={accumulate} is more than the {int(batches)} training batches per "
            f"epoch, so no optimiser step would ever run; use accumulate_grad_batches <= {int(batches)}, or "
            "a smaller batch_size"
        )
    iters = int(batches) // accumulate
    if hp["warmup_epochs"] > epochs:
        raise UserError(f"warmup_epochs={hp['warmup_epochs']} is longer than trainer.max_epochs={epochs}")
    total_batch = per_device_batch * world_size * accumulate
    rule = hp.get("lr_scaling_rule", "linear_wrt_256")
    peak_lr = scaled_lr(hp["lr"], total_batch, rule) if hp["scale_lr_with_batch"] else hp["lr"]
    # DINOv3 scales the schedule's end with its peak (train.py, build_schedulers_v2); DINO scales the peak only.
    sqrt_rule = hp["scale_lr_with_batch"] and rule == "sqrt_wrt_1024"
    min_lr = scaled_lr(hp["min_lr"], total_batch, rule) if sqrt_rule else hp["min_lr"]
    return Schedules(
        lr=cosine_schedule(peak_lr, min_lr, epochs, iters, warmup_epochs=hp["warmup_epochs"]),
        weight_decay=cosine_schedule(hp["weight_decay"], hp["weight_decay_end"], epochs, iters),
        momentum=cosine_schedule(
            hp["momentum_teacher"], hp.get("final_momentum_teacher", 1.0), epochs, iters
        ),
        iters_per_epoch=iters,
        total_batch=total_batch,
        peak_lr=peak_lr,
        ibot_weight=linear_warmup(
            hp.get("ibot_loss_weight", 0.0), hp.get("ibot_weight_warmup_epochs", 0.0), epochs, iters
        ),
        gram_weight=gram_ramp(
            hp.get("gram_loss_weight", 0.0),
            hp.get("gram_start_step", 0),
            hp.get("gram_weight_warmup_steps", 0),
            epochs * iters,
        ),
        local_weight=local_weight_ramp(
            hp.get("local_crops_weight", 1.0),
            hp.get("gram_start_step", 0),
            hp.get("gram_weight_warmup_steps", 0),
            epochs * iters,
        ),
    )


def linear_warmup(value: float, warmup_epochs: float, epochs: int, iters_per_epoch: int) -> np.ndarray:
    """``value`` per iteration, rising linearly from 0 over the first ``warmup_epochs`` (0: constant)."""
    schedule = np.full(epochs * iters_per_epoch, float(value))
    ramp = min(len(schedule), round(warmup_epochs * iters_per_epoch))
    if ramp > 0:
        schedule[:ramp] = value * np.arange(ramp) / ramp
    return schedule


def gram_ramp(value: float, start_step: int, warmup_steps: int, total_steps: int) -> np.ndarray | None:
    """The Gram term's weight per iteration, DINOv3's ``linear_warmup_cosine_decay(start=0, peak=0, end=value,
    warmup_iterations=start_step, cosine_iterations=warmup_steps)``: 0 before ``start_step``, then
    ``value * (1 - cos(pi * k / (warmup_steps - 1))) / 2`` at ``start_step + k`` for ``0 <= k < warmup_steps``
    (a half cosine from 0 up to ``value`` at its last step; one step: 0), then ``value`` (0: ``value`` at once).
    At least one entry past the ramp, so a term that starts after the planned run, or a run extended past it,
    reads ``value``. None when ``value`` is 0 (the term is off)."""
    if not value > 0:
        return None
    schedule = np.full(max(total_steps, start_step + warmup_steps + 1), float(value))
    schedule[:start_step] = 0.0
    if warmup_steps > 0:
        rise = (1.0 - np.cos(np.linspace(0.0, np.pi, warmup_steps))) / 2.0
        schedule[start_step : start_step + warmup_steps] = value * rise
    return schedule


def local_weight_ramp(end: float, start_step: int, warmup_steps: int, total_steps: int) -> np.ndarray | None:
    """The local crops' DINO weight per iteration, eased from 1 to ``end`` on the Gram ramp (DINOv3's 7B
    ``dino.local_loss_weight_schedule``, ``dinov3/configs/train/dinov3_vit7b16_gram_anchor.yaml``: start 1, peak 1,
    end 0.5 over the Gram weight's warm-up and cosine): 1 before ``start_step``, then ``1 + (end - 1) * (1 -
    cos(pi * k / (warmup_steps - 1))) / 2`` at ``start_step + k`` for ``0 <= k < warmup_steps``, then ``end``
    (``end`` at once without a warm-up). None when ``end`` is 1 (no reweighting)."""
    if end == 1.0:
        return None
    schedule = np.full(max(total_steps, start_step + warmup_steps + 1), float(end))
    schedule[:start_step] = 1.0
    if warmup_steps > 0:
        rise = (1.0 - np.cos(np.linspace(0.0, np.pi, warmup_steps))) / 2.0
        schedule[start_step : start_step + warmup_steps] = 1.0 + (end - 1.0) * rise
    return schedule


def configured_batch_size(loader: Any) -> int:
    """A training loader's configured per-device batch size. The schedules are sized from it, never from an
    actual batch: skipped unreadable images shrink a batch, which would lower the peak lr for the whole run
    and, under DDP, give the ranks different schedules."""
    loader = getattr(loader, "iterables", loader)  # Lightning's CombinedLoader
    if isinstance(loader, dict):
        loader = next(iter(loader.values()))
    elif isinstance(loader, (list, tuple)):
        loader = loader[0]
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    if not size:
        raise UserError(
            f"DINO sizes its lr schedule from the loader's batch_size, but {type(loader).__name__} has none; "
            "use a DataLoader with batch_size set"
        )
    return int(size)
