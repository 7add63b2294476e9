"""DDP with ``accumulate_grad_batches=2``: ``python accumulation_worker.py OUT_DIR`` under ``torchrun
--nproc_per_node 2`` (gloo). Two runs in the same processes, from the same weights and data: ``windowed`` as
DINO trains, and ``every`` with the strategy's ``block_backward_sync`` disabled (a gradient all-reduce on every
micro-batch: the behaviour before one reduction per window). A DDP comm hook counts the bucket all-reduces of
each micro-batch; a callback keeps the gradients each optimiser step sees. Writes ``OUT_DIR/<run>_rank<r>.pt``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from ddp_worker import FixedCrops, build
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, DistributedSampler

MICRO_BATCH = 2  # per rank: 16 images, 2 ranks -> 4 micro-batches each, 2 windows of 2


class Counter:
    def __init__(self) -> None:
        self.reductions = 0

    def hook(self, state, bucket):
        self.reductions += 1
        return default_hooks.allreduce_hook(state, bucket)


class Record(L.Callback):
    def __init__(self, counter: Counter) -> None:
        self.counter, self.per_batch, self.grads = counter, [], []
        self._seen = 0

    def on_train_start(self, trainer, pl_module):
        # Lightning's own ddp_comm_hook argument is registered on CUDA only.
        trainer.strategy.model.register_comm_hook(None, self.counter.hook)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.per_batch.append(self.counter.reductions - self._seen)
        self._seen = self.counter.reductions

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # before the module clips
        self.grads.append(
            {
                n: p.grad.detach().clone()
                for n, p in pl_module.student.named_parameters()
                if p.grad is not None
            }
        )


def run(out: Path, name: str) -> None:
    from ssl_xcit.data.datasets import collate_train

    counter = Counter()
    record = Record(counter)
    model = build(accumulate_grad_batches=2)
    strategy = DDPStrategy()
    if name == "every":
        strategy.block_backward_sync = contextlib.nullcontext
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[record], use_distributed_sampler=False,
    )  # fmt: skip
    dataset = FixedCrops()
    sampler = DistributedSampler(dataset, 2, int(os.environ["RANK"]), shuffle=False, drop_last=True)
    loader = DataLoader(dataset, batch_size=MICRO_BATCH, sampler=sampler, collate_fn=collate_train)
    trainer.fit(model, loader)
    result = {"per_batch": record.per_batch, "grads": record.grads, "global_step": trainer.global_step}
    torch.save(result, out / f"{name}_rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    for run_name in ("windowed", "every"):
        run(Path(sys.argv[1]), run_name)
