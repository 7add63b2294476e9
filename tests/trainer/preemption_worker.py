"""Pre-emption under DDP: ``python preemption_worker.py OUT_DIR [WHEN]`` under ``torchrun --nproc_per_node 2``.

Only rank 1 gets SIGTERM: with WHEN ``batch`` (the default) at the start of its batch 2, with ``sanity``
during sanity validation (before ``on_train_start``, where Lightning's own handler would broadcast from inside
the signal handler on rank 1 alone). The ranks agree through the callback's gloo group and both stop at the
same point, with one checkpoint. Each rank saves ``OUT_DIR/rank<R>.pt``: its global step, exit code and
checkpoint path.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch
from conftest import RandomCrops, tiny_model
from torch.utils.data import DataLoader

from ssl_xcit.data.datasets import collate_train
from ssl_xcit.data.resumable import resumable_loader
from ssl_xcit.trainer.preemption import Preempted, PreemptionCheckpoint


class SignalRank1(L.Callback):
    def __init__(self, when: str) -> None:
        self.when = when

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.when == "batch" and batch_idx == 2 and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if self.when == "sanity" and trainer.sanity_checking and batch_idx == 0 and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def main(out: Path, when: str) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    rank = int(os.environ["RANK"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=[SignalRank1(when), PreemptionCheckpoint()],
    )
    loader = resumable_loader(RandomCrops(64), 4, collate_train, world_size=2, rank=rank)
    result = {"code": None, "checkpoint": None}
    try:
        val = DataLoader(RandomCrops(16), batch_size=4, collate_fn=collate_train)  # Lightning splits it
        trainer.fit(tiny_model(), loader, val_dataloaders=val if when == "sanity" else None)
    except Preempted as stopped:
        result = {"code": stopped.code, "checkpoint": str(stopped.checkpoint)}
    result["global_step"] = trainer.global_step
    torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "batch")
