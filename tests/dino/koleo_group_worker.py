"""DINOv3's distributed KoLeo on 2 gloo processes: ``python koleo_group_worker.py OUT_DIR`` under ``torchrun
--nproc_per_node 2``. For each case of ``CASES`` (rows of rank 0, rows of rank 1, group size), each rank takes
its rows of ``global_batch(case)``, computes ``grouped_koleo_loss`` and its gradient, and saves both to
``OUT_DIR/rank<R>.pt``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ssl_xcit.dino.koleo import grouped_koleo_loss

# spans: groups of 8 over 4 + 4 rows (DINOv3's case: group = 2 ranks' batches); within: groups of 2 inside each
# rank (no gather); uneven: rank 1 dropped an image (4 + 3 rows, groups of 8 slots).
CASES = {"spans": (4, 4, 8), "within": (4, 4, 2), "uneven": (4, 3, 8)}


def global_batch(case: str) -> torch.Tensor:
    n0, n1, _ = CASES[case]
    return torch.randn(n0 + n1, 6, generator=torch.Generator().manual_seed(len(case)), dtype=torch.float64)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for case, (n0, n1, group) in CASES.items():
        rows = global_batch(case)[:n0] if rank == 0 else global_batch(case)[n0 : n0 + n1]
        x = rows.float().requires_grad_(True)
        loss = grouped_koleo_loss(x, group)
        loss.backward()
        results[case] = {"loss": loss.detach(), "grad": x.grad}
    torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()
    os._exit(0)  # as collectives_worker.py: what the test reads is saved


if __name__ == "__main__":
    main(Path(sys.argv[1]))
