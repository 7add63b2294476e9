"""BatchNorm synchronised across processes, for XCiT's BatchNorm layers (patch embedding and LPI) under DDP.

The reference hard-codes ``nn.SyncBatchNorm`` in XCiT, so every BN layer normalises with the statistics of
the global batch. :class:`AllReduceBatchNorm` computes the same global statistics with one differentiable
all-reduce of the per-channel sum and sum of squares, on every device. torch's ``SyncBatchNorm`` is not used:
it refuses CPU tensors once a process group exists, and on CUDA it reads the host in every training forward
(``count_all[mask]``, a data-dependent shape), about 48 waits per XCiT-S12 step and a graph break under
``compile``. Ours keeps every number on the device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class _AllReduceSum(torch.autograd.Function):
    """Sum over the ranks whose backward is the sum of the incoming gradients over the ranks (the all-reduce's
    adjoint). Ours, not the functional all-reduce's own formula: torch gained that only in late 2025, and
    ``pyproject.toml`` allows torch 2.6, where the gradient through the global statistics would be dropped
    with only a warning. ``compile`` traces a custom Function and the functional collectives inside it."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(tensor, "sum", dist.group.WORLD))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", dist.group.WORLD))


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Differentiable sum of ``tensor`` over every rank of the default group, on every allowed torch."""
    return _AllReduceSum.apply(tensor)


class AllReduceBatchNorm(_BatchNorm):
    """BatchNorm over the union of all processes' batches; any input rank (N, C, ...).

    Gradients are exact: the all-reduce's backward (:func:`all_reduce_sum`) sums the incoming gradients of the
    reduced statistics across processes, just as the forward sums the statistics.
    Outside training, or without an initialised process group, it is a plain BatchNorm.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (
            self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        ):
            return super().forward(x)
        self._check_input_dim(x)
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        xf = x.float()
        # The local count is made on the device (a fill from a Python number, no host-to-device copy).
        local_count = xf.new_full((1,), xf.numel() // max(channels, 1))
        stats = torch.cat([xf.sum(dims), (xf * xf).sum(dims), local_count])
        # Differentiable on every torch (its backward sums the gradients over the ranks), traced by `compile`.
        stats = all_reduce_sum(stats)
        count = stats[-1]
        mean = stats[:channels] / count
        var = (stats[channels : 2 * channels] / count - mean * mean).clamp_min(0)

        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                # momentum None is a cumulative average; 1 / n stays a device tensor (no host read).
                momentum = 1.0 / self.num_batches_tracked.float() if self.momentum is None else self.momentum
                unbiased = var * count / (count - 1).clamp_min(1)
                self.running_mean.mul_(1 - momentum).add_(mean.detach() * momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.detach() * momentum)

        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every BatchNorm in ``module`` by :class:`AllReduceBatchNorm`, on every device. Parameters and
    buffers are shared, not copied, so state-dict keys and optimiser references are unchanged."""
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, (AllReduceBatchNorm, nn.SyncBatchNorm)):
        out = AllReduceBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        if module.affine:
            out.weight = module.weight
            out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child))
    return out


def has_batchnorms(module: nn.Module) -> bool:
    return any(isinstance(m, _BatchNorm) for m in module.modules())
