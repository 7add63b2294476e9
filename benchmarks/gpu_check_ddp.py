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
(4 per rank), so each micro-batch of the 2-process run is the union of the ranks' halves of the 1-process one;
``fsdp2``: ``--trainer.strategy fsdp2`` at either size (a 1-rank mesh for 1 process; NCCL on CUDA);
``fsdp2_bf16``: the same in ``bf16-mixed``, recording the dtypes its first block computes in and the sharded
parameters' and gradients' dtypes (DINOv3's policy: bf16 compute, float32 master weights and reduction).
Writes OUT/teacher_ws{WORLD_SIZE}_{MODE}.pt (rank 0): the teacher's state dict (gathered whole under FSDP2),
the optimiser steps and, for ``fsdp2_bf16``, the dtypes.
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


MODES = ("plain", "compile", "accumulate", "fsdp2", "fsdp2_bf16")


class Dtypes(L.Callback):
    """The dtype of the first block's weights as its forward sees them, and the sharded parameters' and
    their gradients' dtypes before each optimiser step."""

    def __init__(self) -> None:
        self.compute: set[str] = set()
        self.params: set[str] = set()
        self.grads: set[str] = set()

    def on_train_start(self, trainer, pl_module):
        from ssl_xcit.models.activation_checkpointing import blocks

        block = blocks(pl_module.student.backbone)[0]
        block.register_forward_pre_hook(lambda m, a: self.compute.add(str(next(m.parameters()).dtype)))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for p in pl_module.student.parameters():
            self.params.add(f"{type(p).__name__} {p.dtype}")
            if p.grad is not None:
                self.grads.add(str(p.grad.dtype))


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
    strategy = "ddp" if world_size > 1 else "auto"
    if mode.startswith("fsdp2"):
        import ssl_xcit.parallel.fsdp  # noqa: F401 (registers the strategy names)

        strategy = "fsdp2"
    dtypes = Dtypes()
    trainer = L.Trainer(
        accelerator=accelerator, devices=world_size, strategy=strategy,
        callbacks=[dtypes] if mode.startswith("fsdp2") else [],
        precision="bf16-mixed" if mode == "fsdp2_bf16" else "32-true", max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
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
    from ssl_xcit.parallel.fsdp import whole_state_dict

    state = {k: v.cpu() for k, v in whole_state_dict(model.teacher).items()}  # every rank: FSDP2 gathers
    if trainer.global_rank == 0:
        result = {"teacher": state, "steps": trainer.global_step,
                  "dtypes": {k: sorted(getattr(dtypes, k)) for k in ("compute", "params", "grads")}}  # fmt: skip
        torch.save(result, Path(out) / f"teacher_ws{world_size}_{mode}.pt")


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), *sys.argv[5:6])
