"""Issue 42's 2-process checks in one launch: ``python loop_worker.py OUT_DIR MODE[,MODE...]`` under ``torchrun
--nproc_per_node 2`` (gloo); each mode writes ``OUT_DIR/<mode>_rank<r>.pt``.

- ``skip``: ``fit`` with accumulation 2 (2 images per rank and micro-batch) over 3 windows: window 0's closing
  micro-batch is unreadable on rank 1 only (every rank skips it, after window 0's first micro-batch had
  accumulated under DDP's ``no_sync``), window 1 is unreadable everywhere, window 2 is whole. With WORLD_SIZE
  1 (``run_skip(out, 1)`` in the test's own process) it is the 1-process run over the same global batches.
- ``syncbn``: ``AllReduceBatchNorm``'s input, weight and bias gradients over both ranks' halves of a batch, once
  with torch's functional all-reduce as it is and once with that all-reduce stripped of its autograd formula
  (as on a torch before it gained one).
- ``sigterm``: ``fit`` with ``PreemptionCheckpoint`` where rank 1 cannot own SIGTERM (its handler is not
  installed, as off the main thread): the ranks must decide together whether Lightning's per-step SIGTERM
  broadcast stays, or one rank would broadcast alone and the run hang.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from ddp_worker import FixedCrops, build
from torch.utils.data import DataLoader, DistributedSampler

MICRO = 2  # images per rank and micro-batch
# Global micro-batches of 4: [0-3] [4-7] | [8-11] [12-15] | [16-19] [20-23]. Rank 1 holds the odd indices, so
# {5, 7} empties its half of window 0's closing micro-batch (rank 0's half, {4, 6}, is readable).
UNREADABLE_2 = frozenset({5, 7, *range(8, 16)})
UNREADABLE_1 = frozenset(range(4, 16))  # one process: the same micro-batches skipped (it skips a batch only
# when none of its images is readable)


class Items(FixedCrops):
    def __len__(self) -> int:
        return 24


class Grads(L.Callback):
    """The gradients each optimiser step sees (before the module's clip), and the step count."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append(
            {
                n: p.grad.detach().clone()
                for n, p in pl_module.student.named_parameters()
                if p.grad is not None
            }
        )


def run_skip(out: Path, world_size: int) -> dict:
    from ssl_xcit.data.datasets import collate_train

    model = build(accumulate_grad_batches=2)
    grads = Grads()
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy="ddp" if world_size > 1 else "auto", max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[grads], use_distributed_sampler=False,
    )  # fmt: skip
    dataset = Items(UNREADABLE_2 if world_size > 1 else UNREADABLE_1)
    sampler = None
    if world_size > 1:
        sampler = DistributedSampler(
            dataset, world_size, int(os.environ["RANK"]), shuffle=False, drop_last=True
        )
    loader = DataLoader(dataset, MICRO * 2 // world_size, sampler=sampler, collate_fn=collate_train)
    trainer.fit(model, loader)
    result = {
        "global_step": trainer.global_step,
        "skipped": model.skipped_batches,
        "grads": grads.grads,
        "student": {k: v.detach().clone() for k, v in model.student.state_dict().items()},
        "teacher": {k: v.detach().clone() for k, v in model.teacher.state_dict().items()},
    }
    torch.save(result, out / f"skip_rank{trainer.global_rank}.pt")
    return result


def _bn_grads(x: torch.Tensor, rank: int) -> dict[str, torch.Tensor]:
    from ssl_xcit.parallel.syncbn import AllReduceBatchNorm

    torch.manual_seed(3)
    bn = AllReduceBatchNorm(3)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    half = x.chunk(2)[rank].clone().requires_grad_(True)
    weights = torch.linspace(-1, 2, half[0].numel()).view_as(half[0])  # a loss that is not symmetric
    (bn(half) * weights).square().sum().backward()
    return {"input": half.grad, "weight": bn.weight.grad, "bias": bn.bias.grad}


def run_syncbn(out: Path) -> None:
    import torch.distributed._functional_collectives as funcol

    rank = dist.get_rank()
    x = torch.randn(8, 3, 5, 5, generator=torch.Generator().manual_seed(0)) * 2 + 1
    result = {"exact": _bn_grads(x, rank)}
    original = funcol.all_reduce

    def without_autograd(tensor, *args, **kwargs):  # a torch whose functional all-reduce has no backward
        return original(tensor.detach(), *args, **kwargs)

    funcol.all_reduce = without_autograd
    try:
        result["no_funcol_autograd"] = _bn_grads(x, rank)
    finally:
        funcol.all_reduce = original
    torch.save(result, out / f"syncbn_rank{rank}.pt")


def run_sigterm(out: Path) -> None:
    from conftest import RandomCrops, tiny_model

    from ssl_xcit.data.datasets import collate_train
    from ssl_xcit.trainer import sigterm_broadcast
    from ssl_xcit.trainer.preemption import PreemptionCheckpoint

    rank = int(os.environ["RANK"])
    callback = PreemptionCheckpoint()
    if rank == 1:  # rank 1 cannot install its handler, as off the main thread: Lightning keeps SIGTERM there
        callback._install = lambda signums: None
    silenced = []
    original = sigterm_broadcast.silence
    sigterm_broadcast.silence = lambda trainer: silenced.append(True) or original(trainer)
    try:
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, limit_train_batches=3, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=out, callbacks=[callback],
        )  # fmt: skip
        loader = DataLoader(RandomCrops(16), batch_size=2, collate_fn=collate_train)
        trainer.fit(tiny_model(), loader)
    finally:
        sigterm_broadcast.silence = original
    torch.save(
        {"global_step": trainer.global_step, "silenced": bool(silenced)}, out / f"sigterm_rank{rank}.pt"
    )


if __name__ == "__main__":
    target = Path(sys.argv[1])
    torch.set_num_threads(1)
    for mode in sys.argv[2].split(","):
        if mode == "skip":
            run_skip(target, 2)
        elif mode == "syncbn":
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            run_syncbn(target)
        elif mode == "sigterm":
            run_sigterm(target)
