"""BatchNorm statistics of the student's masked pass taken from its unmasked crops only (``ibot_bn_stats``).

XCiT has BatchNorm in its convolutional stem and in every block's local patch interaction. In iBOT's masked
pass, half of the global crops carry blanked pixels and mask tokens, which the teacher never sees: in training
mode the student normalises with statistics that partly describe those blanks, and its running statistics
(which the teacher's EMA copies) drift towards them. ``unmasked`` normalises the whole batch with the
statistics of the crops that have no masked patch, and updates the running statistics from those alone.

The per-crop weights are device tensors computed from the mask (``~mask.any(1)``), so no count is read back on
the host. PyTorch's BatchNorm has no per-sample weights, so the normalisation is written out here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ssl_xcit.errors import UserError
from ssl_xcit.models.base import list_input
from ssl_xcit.parallel.syncbn import AllReduceBatchNorm


def weighted_batch_norm(bn: nn.BatchNorm2d, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``bn`` in training mode on ``x`` (B, C, H, W), its statistics from the crops of weight 1 in ``weights``
    (B,); all crops count when none has weight 1."""
    if not bn.training:
        return bn(x)
    weights = weights.to(x.dtype)
    total = weights.sum()
    weights = torch.where(total > 0, weights, torch.ones_like(weights))
    count = weights.sum() * x.shape[2] * x.shape[3]
    w = weights.view(-1, 1, 1, 1)
    xf = x.float()
    mean = (xf * w).sum(dim=(0, 2, 3)) / count
    var = ((xf - mean.view(1, -1, 1, 1)).square() * w).sum(dim=(0, 2, 3)) / count
    if bn.track_running_stats and bn.running_mean is not None:
        with torch.no_grad():
            momentum = bn.momentum if bn.momentum is not None else 0.1
            unbiased = var * count / (count - 1).clamp_min(1)
            bn.running_mean.lerp_(mean.to(bn.running_mean.dtype), momentum)
            bn.running_var.lerp_(unbiased.to(bn.running_var.dtype), momentum)
            bn.num_batches_tracked.add_(1)
    out = (xf - mean.view(1, -1, 1, 1)) * torch.rsqrt(var.view(1, -1, 1, 1) + bn.eps)
    if bn.affine:
        out = out * bn.weight.view(1, -1, 1, 1) + bn.bias.view(1, -1, 1, 1)
    return out.to(x.dtype)


@contextlib.contextmanager
def statistics_from_unmasked(module: nn.Module, mask: torch.Tensor, element: int = 0) -> Iterator[None]:
    """Within the block, every BatchNorm2d of ``module`` in training mode that sees a batch of ``mask``'s size
    takes its statistics from the crops without masked patches (``mask`` (B, N) bool). Inside a list forward
    (``forward_cls_patches_list``: the masked crops and the local ones in one call) only while it computes its
    input ``element``, the masked one; the others keep their own plain statistics, as in a call of their own."""
    if any(isinstance(m, (nn.SyncBatchNorm, AllReduceBatchNorm)) for m in module.modules()):
        # Statistics of a subset of crops would need their own all-reduce; this diagnosis option is not worth it
        # (docs/ibot.md: it changed nothing measurable), so it refuses rather than silently doing nothing.
        # Both synchronised kinds count: `sync_batchnorm` gives AllReduceBatchNorm, a user's model may bring
        # torch's SyncBatchNorm, and neither is a BatchNorm2d this function would patch.
        raise UserError(
            "ibot_bn_stats: unmasked works on one process (no SyncBatchNorm); use ibot_bn_stats: all with "
            "several processes or sync_batchnorm"
        )
    weights = (~mask.any(dim=1)).float()
    norms = [m for m in module.modules() if isinstance(m, nn.BatchNorm2d)]

    def patched(bn: nn.BatchNorm2d):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] != weights.shape[0] or list_input() not in (None, element):  # not the masked batch
                return type(bn).forward(bn, x)
            return weighted_batch_norm(bn, x, weights)

        return forward

    for bn in norms:
        bn.forward = patched(bn)  # an instance attribute: nn.Module.__call__ finds it before the class's
    try:
        yield
    finally:
        for bn in norms:
            del bn.forward
