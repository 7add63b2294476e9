"""BatchNorm synchronised across processes, for XCiT's BatchNorm layers (patch embedding and LPI) under DDP.

The reference hard-codes ``nn.SyncBatchNorm`` in XCiT, so every BN layer normalises with the statistics of
the global batch. On CUDA we use torch's ``SyncBatchNorm``. torch's version refuses CPU tensors once a
process group exists, so for CPU (gloo) runs -- tests and laptops -- :class:`AllReduceBatchNorm` computes the
same global statistics with a differentiable all-reduce of the per-channel sum and sum of squares.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class AllReduceBatchNorm(_BatchNorm):
    """BatchNorm over the union of all processes' batches; any input rank (N, C, ...).

    Gradients are exact: ``torch.distributed.nn.functional.all_reduce`` sums the incoming gradients of the
    reduced statistics across processes in the backward pass, just as the forward sums the statistics.
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
        local_count = torch.tensor([xf.numel() / channels], dtype=torch.float32, device=x.device)
        stats = torch.cat([xf.sum(dims), (xf * xf).sum(dims), local_count])
        stats = dist_fn.all_reduce(stats)
        count = stats[-1]
        mean = stats[:channels] / count
        var = (stats[channels : 2 * channels] / count - mean * mean).clamp_min(0)

        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                unbiased = var * count / (count - 1).clamp_min(1)
                self.running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.detach(), alpha=momentum)

        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def convert_sync_batchnorm(module: nn.Module, device_type: str) -> nn.Module:
    """Replace every BatchNorm in ``module`` by its synchronised version for ``device_type`` ('cuda' -> torch's
    SyncBatchNorm, anything else -> :class:`AllReduceBatchNorm`). Parameters and buffers are shared, not
    copied, so state-dict keys and optimiser references are unchanged."""
    if device_type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return _convert_cpu(module)


def _convert_cpu(module: nn.Module) -> nn.Module:
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
        out.add_module(name, _convert_cpu(child))
    return out


def has_batchnorms(module: nn.Module) -> bool:
    return any(isinstance(m, _BatchNorm) for m in module.modules())
