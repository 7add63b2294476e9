"""The multi-process rows of ``gpu_check.py``: ``python gpu_check_ddp.py OUT WORLD_SIZE ACCELERATOR SIZE [MODE]``.

Under ``torchrun --nproc_per_node 2`` it is a 2-process Lightning DDP run (NCCL on CUDA, gloo on a CPU); with
WORLD_SIZE 1 the single-process run at the same total batch. The quickstart's model and centring; what
would make the two runs differ by design is off: no drop path and no KoLeo (per rank in DINOv2), fixed crops
instead of random augmentation, an unshuffled sampler (rank r gets samples r, r + 2, ..., so the union of the
ranks' batches is the single-process batch). SGD rather than AdamW: AdamW's division by sqrt(v) turns float
noise on near-zero gradients into full-size steps, which would hide a real disagreement behind a loose
tolerance. fp32 with TF32 off, so the only difference left is the order of the reductions.

MODE ``plain`` (the default); ``compile``: both runs with ``compile: true`` (DDP around compiled backbones,
synchronised BatchNorm inside them); ``accumulate``: both runs accumulate 2 micro-batches of 8 images per step
(4 per rank), so each micro-batch of the 2-process run is the union of the ranks' halves of the 1-process one.
Writes OUT/teacher_ws{WORLD_SIZE}_{MODE}.pt (rank 0): the teacher's state dict and the optimiser steps.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ssl_xcit.data.datasets import collate_train
from ssl_xcit.dino.module import DINO

GLOBAL_BATCH, STEPS = 16, 3


class FixedCrops(Dataset):
    """Deterministic multi-crop items (no RNG state shared with anything), identical in both runs."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return GLOBAL_BATCH * STEPS

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(1000 + i)
        sizes = (self.size, self.size, self.size // 2, self.size // 2)
        return [torch.randn(3, s, s, generator=g) + (i % 3) for s in sizes], i % 3, i


MODES = ("plain", "compile", "accumulate")


def run(out: str, world_size: int, accelerator: str, size: int, mode: str = "plain") -> None:
    if mode not in MODES:
        raise SystemExit(f"MODE must be one of {', '.join(MODES)}, got {mode!r}")
    accumulate = 2 if mode == "accumulate" else 1
    if mode == "compile" and accelerator == "cpu":
        # The dry run: inductor's C++ code generation for three processes took over 10 minutes on 2 busy
        # cores. aot_eager makes the same graphs (dynamo, DDP's split at bucket boundaries, AOT autograd's
        # forward and backward) and runs them without generating code.
        compile_fn = torch.compile
        torch.compile = lambda fn=None, **kw: compile_fn(fn, **{**kw, "backend": "aot_eager"})
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    L.seed_everything(0, verbose=False)
    model = DINO(
        backbone="xcit_nano_12_p8", backbone_kwargs={"depth": 2}, drop_path_rate=0.0, out_dim=256,
        centering="sinkhorn_knopp", koleo_weight=0.0, warmup_epochs=0, optimizer="sgd", lr=1.0,
        freeze_last_layer=0, collapse_guard="off", compile=mode == "compile", accumulate_grad_batches=accumulate,
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator=accelerator, devices=world_size, strategy="ddp" if world_size > 1 else "auto",
        precision="32-true", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    dataset = FixedCrops(size)
    sampler = None
    if world_size > 1:
        sampler = DistributedSampler(
            dataset, world_size, int(os.environ["RANK"]), shuffle=False, drop_last=True
        )
    loader = DataLoader(
        dataset,
        batch_size=GLOBAL_BATCH // world_size // accumulate,
        sampler=sampler,
        drop_last=True,
        collate_fn=collate_train,
    )
    trainer.fit(model, loader)
    if trainer.global_rank == 0:
        state = {k: v.detach().cpu() for k, v in model.teacher.state_dict().items()}
        result = {"teacher": state, "steps": trainer.global_step}
        torch.save(result, Path(out) / f"teacher_ws{world_size}_{mode}.pt")


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), *sys.argv[5:6])
