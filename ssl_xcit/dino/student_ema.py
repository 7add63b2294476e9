"""The student EMA of DINOv3's distillation: the model it evaluates and releases.

When DINOv3 distils (``ssl_meta_arch.py``), the teacher is frozen and ``model_ema``, a copy of the student
(backbone and heads), follows it: ``ema <- m * ema + (1 - m) * student`` after every optimiser step, with m on
a cosine from 0.994 to 1 (the distillation config's ``schedules.momentum``). Its evaluations and exports read
``model_ema``, not the student.

DINOv3's networks have only LayerNorms. XCiT's BatchNorms (stem, LPI) keep running statistics, which an EMA
never run forward would leave at their initial values: the floating-point buffers are averaged with the same
momentum as the parameters (as timm's ``ModelEmaV3`` does); integer buffers (batch counts) are copied.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def ema_update_(ema: nn.Module, model: nn.Module, momentum: float) -> None:
    """``ema`` <- momentum x ``ema`` + (1 - momentum) x ``model`` over parameters and float buffers, in place;
    other buffers copied. Both modules have the same structure; under FSDP2 the same units, so the update runs
    on the local shards, after freeing any gathered copy a forward left (it would be stale after the update)."""
    from ssl_xcit.parallel.fsdp import local_parameters

    params = local_parameters(ema)
    source = [p.detach() for p in local_parameters(model)]
    if len(params) != len(source):
        raise ValueError(f"EMA has {len(params)} parameters, the model {len(source)}")
    torch._foreach_mul_(params, momentum)
    torch._foreach_add_(params, source, alpha=1.0 - momentum)
    for mine, theirs in zip(ema.buffers(), model.buffers(), strict=True):
        if mine.is_floating_point():
            mine.mul_(momentum).add_(theirs.detach().to(mine.dtype), alpha=1.0 - momentum)
        else:
            mine.copy_(theirs)
