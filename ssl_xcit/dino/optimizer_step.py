"""The end of a DINO accumulation window: gradient reduction, the reference's gradient surgery, the optimiser
step and the teacher's EMA.

- DDP reduces gradients once per window, in the backward of its closing micro-batch (``gradient_sync``). When
  every rank skips that micro-batch (no readable image on some rank), no backward reduces what the window's
  other micro-batches accumulated: :func:`reduce_local_gradients` does DDP's average explicitly, so the ranks
  step on the same gradients. FSDP2 reduce-scatters in every backward: its gradients need nothing more.
- A window steps on the mean gradient of its readable micro-batches. Each backward divides its loss by k (the
  window's length, known before the window ends); when some micro-batches were skipped (every rank skips
  together), :func:`mean_over_readable` multiplies the sum by k / readable. Without it the step, the
  per-parameter clip and SGD's or LARS's update would shrink by readable / k. Every rank skips the same
  micro-batches, so the factor is the same everywhere and 2 processes still equal 1.
- Under a GradScaler (``16-mixed``), the clip and every callback's ``on_before_optimizer_step`` must see
  gradients in true units. Lightning unscales before those hooks only for optimisers that do not unscale
  themselves; for fused AdamW/SGD (``_step_supports_amp_scaling``) :func:`unscale_for_clip` does it before
  ``opt.step()``, that is before Lightning calls the callbacks' hooks. The fused step then takes GradScaler's
  ``found_inf`` on the device and makes no host read, where a non-fused step reads it with ``.item()``
  (docs/training.md, "Precision").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor

from ssl_xcit.dino.init_from import drop_backbone_gradients, head_warmup_steps
from ssl_xcit.dino.optim import cancel_gradients_last_layer, clip_gradients, clip_per_module
from ssl_xcit.parallel.fsdp import local_parameters


def gradient_sync(trainer: Any, sync: bool) -> Any:
    """Inside a window, DDP's gradient all-reduce waits for its closing micro-batch: the gradients add up
    locally (``no_sync``) and are reduced once, which gives the same average as k reductions."""
    strategy = trainer.strategy
    if sync or not isinstance(strategy, ParallelStrategy):
        return contextlib.nullcontext()
    return strategy.block_backward_sync()


def _sum_all_ranks(tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)


@torch.no_grad()
def reduce_local_gradients(
    params: list[nn.Parameter],
    world_size: int,
    all_reduce: Callable[[torch.Tensor], None] = _sum_all_ranks,
) -> None:
    """Replace each gradient by its mean over the ``world_size`` ranks, as DDP's reduction would have. A
    gradient that is None on some ranks counts as zero there; it stays None only where it is None on every
    rank (so AdamW still skips it, weight decay included). One in-place ``all_reduce`` (sum) of one flat
    buffer: the gradients, then one presence flag per parameter. Every rank must call it at the same point.

    FSDP2's sharded parameters are left alone: it reduce-scatters in every backward (Lightning's
    ``block_backward_sync`` holds back only DDP), so their gradient shards are reduced already."""
    params = [p for p in params if p.requires_grad and not isinstance(p, DTensor)]
    if not params:
        return
    ref = params[0]
    parts = [p.grad.reshape(-1).float() if p.grad is not None else ref.new_zeros(p.numel(), dtype=torch.float32)
             for p in params]  # fmt: skip
    present = [float(p.grad is not None) for p in params]
    flat = torch.cat([*parts, torch.tensor(present, dtype=torch.float32).to(ref.device)])
    all_reduce(flat)
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    flags = flat[total:].tolist()  # a rare path (a skipped closing micro-batch): one host read is fine
    for param, chunk, flag in zip(params, flat[:total].split(sizes), flags, strict=True):
        if flag > 0:
            param.grad = (chunk / world_size).view_as(param).to(param.dtype)


@torch.no_grad()
def mean_over_readable(params: list[nn.Parameter], readable: int, length: int) -> None:
    """Turn the window's accumulated sum of loss / ``length`` gradients into the mean over its ``readable``
    micro-batches (a factor ``length / readable``, applied only when some were skipped). Works on DTensor
    gradient shards too (an elementwise op); a host-side factor, so no host read."""
    if 0 < readable < length:
        for param in params:
            if param.grad is not None:
                param.grad.mul_(length / readable)


def unscale_for_clip(trainer: Any, optimizer: torch.optim.Optimizer) -> None:
    """Unscale the gradients before the step when Lightning will not: under a GradScaler, for an optimiser
    whose step unscales itself (fused AdamW/SGD). Called before ``opt.step()``, so the callbacks' and the
    module's ``on_before_optimizer_step`` (the clip) see true gradients. The step then gets ``grad_scale=None``
    and ``found_inf`` on the device, and skips itself on an overflow as GradScaler would."""
    if scaler_in_use(trainer) and getattr(optimizer, "_step_supports_amp_scaling", False):
        trainer.precision_plugin.scaler.unscale_(optimizer)


def scaler_in_use(trainer: Any) -> bool:
    """Whether ``trainer``'s precision plugin scales the loss (``16-mixed`` with a GradScaler)."""
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    return scaler is not None and scaler.is_enabled()


def before_optimizer_step(module: Any, optimizer: torch.optim.Optimizer) -> None:
    """Order as in the reference: clip (``clip_mode``; true gradients: :func:`window_step` and Lightning unscaled
    them), then cancel the last layer's and the waiting backbone's gradients."""
    clip = module.hparams.clip_grad
    if clip:  # per parameter as DINO's utils.clip_gradients, or per submodule as DINOv3's train.py
        if module.hparams.get("clip_mode", "per_parameter") == "per_module":
            clip_per_module(module.student, clip)
        else:
            clip_gradients(module.student, clip)
    cancel_gradients_last_layer(module.current_epoch, module.student, module.hparams.freeze_last_layer)
    drop_backbone_gradients(module.student, module.global_step, head_warmup_steps(module))


def window_step(module: Any, opt: Any, momentum: float, reduce: bool, readable: int) -> None:
    """The window's centres move, the gradients are reduced when ``reduce`` (the window's closing micro-batch
    was skipped on every rank after others had accumulated), made the mean over the ``readable`` micro-batches
    and unscaled where Lightning will not, then step (-> the callbacks' and the module's
    ``on_before_optimizer_step``: clip), clear, EMA. Neither step nor EMA when the window has no gradients (all
    its micro-batches were skipped)."""
    for targets in module._teacher_targets():
        targets.apply_center()
    params = list(module.student.parameters())
    if reduce:
        reduce_local_gradients(params, module.trainer.world_size)
    if all(p.grad is None for p in params):
        return
    mean_over_readable(params, readable, module.hparams.accumulate_grad_batches)
    # The torch optimiser itself, not Lightning's wrapper: GradScaler keeps its per-optimiser state by id(), and
    # Lightning's step hands it the torch one, which would otherwise be unscaled a second time.
    unscale_for_clip(module.trainer, getattr(opt, "optimizer", opt))
    opt.step()
    opt.zero_grad(set_to_none=True)
    module._update_teacher(momentum)


@torch.no_grad()
def ema_update(teacher: nn.Module, student: nn.Module, momentum: float) -> None:
    """teacher <- m * teacher + (1 - m) * student, over parameters only (buffers are not averaged)."""
    # Local shards under FSDP2 (student and teacher are sharded alike): no gather.
    teacher_params = local_parameters(teacher)
    student_params = [p.detach() for p in local_parameters(student)]
    torch._foreach_mul_(teacher_params, momentum)
    torch._foreach_add_(teacher_params, student_params, alpha=1.0 - momentum)
