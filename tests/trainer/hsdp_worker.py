"""Tiny DINO runs for ``test_hsdp.py``: ``python hsdp_worker.py OUT_DIR`` under ``torchrun --nproc_per_node 4``
trains the same 2 steps under DDP, FSDP2 over all 4 ranks, and HSDP (``replicate_degree`` 2: shards within
ranks {0, 1} and {2, 3}, replicated across them), each written to OUT_DIR/<run>/rank<r>.pt. Clipping is on at
a norm every gradient exceeds, so the norms' reduction over the shards is part of what is compared."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).parents[1] / "dino"))
from ddp_worker import FixedCrops, Record, whole_state  # noqa: E402

WORLD = 4
GLOBAL_BATCH = 8  # FixedCrops holds 2 steps of 8


def run(out_dir: Path, name: str) -> None:
    from ssl_xcit.data.datasets import collate_train
    from ssl_xcit.dino.module import DINO
    from ssl_xcit.parallel.fsdp import FSDP2Strategy

    strategy = {"ddp": "ddp", "fsdp2": FSDP2Strategy(), "hsdp": FSDP2Strategy(replicate_degree=2)}[name]
    L.seed_everything(0, verbose=False)
    model = DINO("xcit_nano_12_p8", backbone_kwargs={"depth": 1}, drop_path_rate=0.0, warmup_epochs=0,
                 optimizer="sgd", lr=2.0, clip_grad=1e-3, freeze_last_layer=0, out_dim=32, head_hidden_dim=32,
                 head_bottleneck_dim=16)  # fmt: skip
    initial = {k: v.detach().clone() for k, v in model.student.state_dict().items()}
    record = Record()
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[record], use_distributed_sampler=False)  # fmt: skip
    dataset = FixedCrops()
    sampler = DistributedSampler(dataset, WORLD, int(os.environ["RANK"]), shuffle=False, drop_last=True)
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // WORLD, sampler=sampler, collate_fn=collate_train)
    trainer.fit(model, loader)
    param = next(model.student.backbone.parameters())
    result = {
        "losses": record.losses,
        "centers": torch.stack(record.centers),
        "initial": initial,
        "student": whole_state(model.student),
        "teacher": whole_state(model.teacher),
        "global_step": trainer.global_step,
        "placements": [str(p) for p in getattr(param, "placements", ())],
    }
    path = out_dir / name
    path.mkdir(parents=True, exist_ok=True)
    torch.save(result, path / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    for name in ("ddp", "fsdp2", "hsdp"):
        run(Path(sys.argv[1]), name)
