"""Pre-emption under DDP: ``python preemption_worker.py OUT_DIR`` under ``torchrun --nproc_per_node 2``.

Only rank 1 gets SIGTERM (at the start of its batch 2); the ranks agree through the callback's gloo group and
both stop after the same step, with one checkpoint. Each rank saves ``OUT_DIR/rank<R>.pt``: its global step,
exit code and checkpoint path.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch
from conftest import RandomCrops, tiny_model

from ssl_xcit.data.datasets import collate_train
from ssl_xcit.data.resumable import resumable_loader
from ssl_xcit.dino.preemption import Preempted, PreemptionCheckpoint


class SignalRank1(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 2 and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def main(out: Path) -> None:
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
        callbacks=[SignalRank1(), PreemptionCheckpoint()],
    )
    loader = resumable_loader(RandomCrops(64), 4, collate_train, world_size=2, rank=rank)
    result = {"code": None, "checkpoint": None}
    try:
        trainer.fit(tiny_model(), loader)
    except Preempted as stopped:
        result = {"code": stopped.code, "checkpoint": str(stopped.checkpoint)}
    result["global_step"] = trainer.global_step
    torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
