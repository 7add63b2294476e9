"""The collectives our code makes beside DDP's, on 2 gloo processes: ``python collectives_worker.py OUT_DIR``
under ``torchrun --nproc_per_node 2``. Each rank saves ``OUT_DIR/rank<R>.pt``.

- ``syncbn``: each rank normalises its part of one fixed batch with ``AllReduceBatchNorm``, for three training
  steps (forward and backward), and keeps the outputs, the gradients and the running statistics. Cases:
  ``even`` (4 and 4 images, channels far from zero mean), ``momentum_none`` (a cumulative average) and
  ``empty`` (rank 1 has no image at all, as when all its images were unreadable).
- ``host_group``: with ``GLOO_SOCKET_IFNAME`` naming an interface this host lacks, as on a node whose
  reachable interface gloo was not told, the host-agreement group cannot form; unset, it forms once and is
  shared.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ssl_xcit.errors import UserError
from ssl_xcit.parallel.step_checks import HostAgreement, host_group
from ssl_xcit.parallel.syncbn import AllReduceBatchNorm

CASES = {"even": (4, 4, 0.1), "momentum_none": (4, 4, None), "empty": (5, 0, 0.1)}


def batch(step: int) -> torch.Tensor:
    """The global batch of ``step`` (8 images, 3 channels at offsets 0, 5 and -20)."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 3, 5, 5, generator=g) * torch.tensor([1.0, 2.0, 0.5]).view(
        1, 3, 1, 1
    ) + torch.tensor([0.0, 5.0, -20.0]).view(1, 3, 1, 1)


def upstream(step: int) -> torch.Tensor:
    """The gradient that reaches the BN's output (a fixed random weighting of the outputs)."""
    return torch.randn(8, 3, 5, 5, generator=torch.Generator().manual_seed(100 + step))


def syncbn(rank: int) -> dict:
    results = {}
    for name, (n0, n1, momentum) in CASES.items():
        bn = AllReduceBatchNorm(3, momentum=momentum)
        with torch.no_grad():
            bn.weight.copy_(torch.tensor([1.0, 0.5, 2.0]))
            bn.bias.copy_(torch.tensor([0.0, 1.0, -1.0]))
        part = slice(0, n0) if rank == 0 else slice(n0, n0 + n1)
        steps = []
        for step in range(3):
            x = batch(step)[part].clone().requires_grad_(True)
            y = bn(x)
            y.backward(upstream(step)[part])
            steps.append({"y": y.detach(), "x_grad": x.grad})
        results[name] = {
            "steps": steps,
            "weight_grad": bn.weight.grad,
            "bias_grad": bn.bias.grad,
            "running_mean": bn.running_mean,
            "running_var": bn.running_var,
            "num_batches_tracked": bn.num_batches_tracked,
        }
    return results


def gloo_group(rank: int) -> dict:
    os.environ["GLOO_SOCKET_IFNAME"] = "no_such_interface0"
    try:
        host_group()
        error = None
    except UserError as err:
        error = str(err)
    del os.environ["GLOO_SOCKET_IFNAME"]
    first = host_group()
    shared = host_group() is first and first is not dist.group.WORLD
    votes = [HostAgreement().any(rank == 1), HostAgreement().any(False)]
    return {"error": error, "shared": shared, "votes": votes}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.save({"syncbn": syncbn(rank), "host_group": gloo_group(rank)}, out / f"rank{rank}.pt")
    dist.barrier()  # both ranks' results are on disk
    # The gloo group ``gloo_group`` fails to open on purpose can abort a process in its C++ teardown
    # ("terminate called without an active exception": once in a full CI run, after both files were written,
    # never in 18 runs of this worker alone). Leave without running destructors; what the test reads is saved.
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
