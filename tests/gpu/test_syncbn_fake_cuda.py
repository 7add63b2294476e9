"""Synchronised BatchNorm under DDP reads nothing on the host: ``sync_batchnorm``'s layers run their training
forward on fake ``cuda`` tensors (``FakeTensorMode``, a 2-rank fake process group whose collectives return at
once) with no device mismatch, no host read, no data-dependent shape and no blocking copy; the backward, which
autograd cannot run on fake CUDA tensors (test_dino_step.py says why), runs on the CPU under a watch that
raises on every host read. torch's own SyncBatchNorm would fail the first check
(``count_all[mask]``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_dino_step import NoBlockingCopies  # tests/gpu is on sys.path: pytest prepends a test file's folder
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from ssl_xcit.parallel.syncbn import AllReduceBatchNorm, convert_sync_batchnorm

# Every way to read a tensor on the host, or to make a shape from its values.
HOST_READS = {
    torch.ops.aten._local_scalar_dense.default,  # .item(), bool(), float(), int()
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.index.Tensor,  # with a boolean mask
}


class NoHostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS and not (
            func is torch.ops.aten.index.Tensor and all(i is None or i.dtype != torch.bool for i in args[1])
        ):
            raise AssertionError(f"host read: {func}")
        return func(*args, **kwargs or {})


@pytest.fixture
def two_fake_ranks():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _model(momentum: float | None) -> nn.Module:
    stem = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.GELU())
    return nn.Sequential(stem, nn.Flatten(2), nn.BatchNorm1d(4, momentum=momentum))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_synchronised_batchnorm_forward_on_fake_cuda_has_no_host_sync(two_fake_ranks, momentum):
    with FakeTensorMode(), torch.device("cuda"):
        model = convert_sync_batchnorm(_model(momentum)).train()
        x = torch.randn(4, 3, 6, 6)
        with NoBlockingCopies():
            y = model(x)
    assert sum(isinstance(m, AllReduceBatchNorm) for m in model.modules()) == 2
    assert y.device.type == "cuda" and y.shape == (4, 4, 16)
    assert (
        model[0][1].running_var.device.type == "cuda"
        and model[0][1].num_batches_tracked.device.type == "cuda"
    )


@pytest.mark.parametrize("momentum", [0.1, None])
def test_synchronised_batchnorm_backward_reads_nothing_on_the_host(two_fake_ranks, momentum):
    model = convert_sync_batchnorm(_model(momentum)).train()
    x = torch.randn(4, 3, 6, 6, requires_grad=True)
    with NoHostReads():
        model(x).square().sum().backward()
    assert x.grad is not None and model[0][1].weight.grad is not None
