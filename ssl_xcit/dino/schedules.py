"""Per-iteration schedules, precomputed as numpy arrays like the reference ``utils.cosine_scheduler``.

Everything DINO varies during training is looked up by the global optimisation step (lr, weight decay,
teacher momentum) or by the epoch (teacher temperature), so a resumed run continues every schedule exactly.
"""

from __future__ import annotations

import numpy as np


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


def scaled_lr(base_lr: float, total_batch_size: int, reference_batch_size: int = 256) -> float:
    """Linear scaling rule of DINO: ``base_lr`` is the peak LR for a batch of 256 images."""
    return base_lr * total_batch_size / reference_batch_size
