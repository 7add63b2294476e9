"""Gram anchoring switched on or off at resume, under DDP and FSDP2, in one 2-process launch:
``python fsdp2_resume_changes_worker.py OUT_DIR STRATEGY[,STRATEGY...] CHANGE[,CHANGE...]``.

For each strategy (``ddp``, ``fsdp2``, ``fsdp2_whole``) and change (``on``: 2 steps without Gram anchoring,
resumed with it from step 3; ``off``: 2 steps anchoring from step 1, resumed without it) the worker trains 2 steps,
saves ``last.ckpt``, resumes it in a fresh model with the changed setting to step 4 and writes
OUT_DIR/<strategy>/<change>/rank<r>.pt: the networks at the resumed fit's start and at its end (whole tensors).
The data and seeds are those of ``tests/dino/fsdp2_worker.py``, so DDP and FSDP2 agree within float32 reduction
order (``test_fsdp2_resume_changes.py``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).parents[1] / "dino"))
from fsdp2_worker import GLOBAL_BATCH, HEAD, Crops  # noqa: E402

GRAM = {"gram_loss_weight": 1.0}
# (pretraining's Gram settings, the resumed run's)
CHANGES = {"on": ({}, {**GRAM, "gram_start_step": 3}), "off": ({**GRAM, "gram_start_step": 1}, {})}


def _networks(model) -> dict:
    from ssl_xcit.parallel.fsdp import whole_state_dict

    gram = model.gram_teacher
    return {
        "student": whole_state_dict(model.student),
        "teacher": whole_state_dict(model.teacher),
        "gram": whole_state_dict(gram) if gram is not None else {},
    }


class AtStart(L.Callback):
    """The networks as the checkpoint's load left them (Lightning restores before ``on_train_start``)."""

    def __init__(self) -> None:
        self.state: dict = {}

    def on_train_start(self, trainer, pl_module):
        self.state = _networks(pl_module)


def _fit(strategy: str, gram: dict, epochs: int, callbacks: list, ckpt_path=None):
    from ssl_xcit.data.datasets import collate_train
    from ssl_xcit.dino.module import DINO

    L.seed_everything(0, verbose=False)
    # SGD, as fsdp2_worker: AdamW would magnify float noise on near-zero gradients.
    model = DINO("xcit_nano_12_p8", backbone_kwargs={"depth": 1}, drop_path_rate=0.0, warmup_epochs=0,
                 optimizer="sgd", lr=2.0, freeze_last_layer=0, **HEAD, **gram)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, use_distributed_sampler=False, num_sanity_val_steps=0)  # fmt: skip
    dataset = Crops((16, 16, 8, 8), gram=bool(gram))
    sampler = DistributedSampler(dataset, 2, int(os.environ["RANK"]), shuffle=False, drop_last=True)
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // 2, sampler=sampler, collate_fn=collate_train)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return trainer, model


def run(out: Path, strategy: str, change: str) -> None:
    before, after = CHANGES[change]
    folder = out / strategy / change
    folder.mkdir(parents=True, exist_ok=True)
    trainer, _ = _fit(strategy, before, 1, [])  # 2 steps an epoch
    ckpt = folder / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    start = AtStart()
    trainer, model = _fit(strategy, after, 2, [start], ckpt_path=ckpt)
    result = {"start": start.state, "end": _networks(model), "global_step": trainer.global_step}
    torch.save(result, folder / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    for change in sys.argv[3].split(","):
        for strategy in sys.argv[2].split(","):
            run(Path(sys.argv[1]), strategy, change)
