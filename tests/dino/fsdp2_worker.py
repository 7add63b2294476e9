"""Tiny DINO runs of every backbone family under DDP and FSDP2 in one 2-process launch:
``python fsdp2_worker.py OUT_DIR CASE[,CASE...]``, each CASE written to OUT_DIR/<case>/<strategy>/rank<r>.pt.

A case is a backbone family (``CASES``) or a DINO option on XCiT (Gram anchoring, iBOT, bf16-mixed, activation
checkpointing). Both
strategies see the same pixels (``ddp_worker.FixedCrops``-style, deterministic) from the same seed, so their
results agree within float32 reduction order (``test_fsdp2.py``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, str(Path(__file__).parent))
from ddp_worker import Record, whole_state  # noqa: E402

GLOBAL_BATCH = 8
STEPS = 2
HEAD = dict(out_dim=32, head_hidden_dim=32, head_bottleneck_dim=16)
# (backbone, backbone_kwargs, crop sides (2 global + 2 local), DINO overrides)
CASES: dict[str, tuple[str, dict, tuple[int, ...], dict[str, Any]]] = {
    "xcit": ("xcit_nano_12_p8", {"depth": 1}, (16, 16, 8, 8), {}),
    "cait": ("cait_xxs24", {"depth": 1, "patch_size": 8}, (16, 16, 8, 8), {}),
    "vit": ("vit_tiny_patch16_224", {"depth": 1, "patch_size": 8}, (16, 16, 8, 8), {}),
    "crossformerpp": ("crossformerpp_small", {"depths": (1, 1, 1, 1)}, (32, 32, 32, 32), {}),
    "bixt": ("bixt_ti_l64_p16", {"depth": 2}, (32, 32, 16, 16), {}),
    "gram": (
        "xcit_nano_12_p8",
        {"depth": 1},
        (16, 16, 8, 8),
        {"gram_loss_weight": 1.0, "gram_start_step": 1},
    ),
    "ibot": ("xcit_nano_12_p8", {"depth": 1}, (16, 16, 8, 8), {"ibot_loss_weight": 1.0}),
    "bf16": ("xcit_nano_12_p8", {"depth": 1}, (16, 16, 8, 8), {}),
    "ac": ("xcit_nano_12_p8", {"depth": 1}, (16, 16, 8, 8), {"activation_checkpointing": True}),
}


class Crops(Dataset):
    """Deterministic multi-crop items of the given sides; with ``gram``, also the Gram teacher's crops a model
    that anchors needs (gram_resolution_scale 1: the global crops' own boxes, as the datamodule cuts them)."""

    def __init__(self, sides: tuple[int, ...], gram: bool = False) -> None:
        self.sides, self.gram = sides, gram

    def __len__(self) -> int:
        return GLOBAL_BATCH * STEPS

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(1000 + i)
        crops = [torch.randn(3, s, s, generator=g) + (i % 3) for s in self.sides]
        if self.gram:
            return {"crops": crops, "gram_crops": [c.clone() for c in crops[:2]]}, i % 3, i
        return crops, i % 3, i


class ComputeDtype(L.Callback):
    """The dtype of the first block's weights as its forward sees them (FSDP2 gathers them in param_dtype)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def on_train_start(self, trainer, pl_module):
        from ssl_xcit.parallel.fsdp import blocks

        block = blocks(pl_module.student.backbone)[0]
        block.register_forward_pre_hook(lambda m, a: self.seen.add(str(next(m.parameters()).dtype)))


def build(case: str):
    from ssl_xcit.dino.module import DINO

    backbone, kwargs, _, overrides = CASES[case]
    L.seed_everything(0, verbose=False)
    # SGD, as ddp_worker: AdamW would magnify float noise on near-zero gradients.
    return DINO(backbone, backbone_kwargs=kwargs, drop_path_rate=0.0, warmup_epochs=0, optimizer="sgd", lr=2.0,
                freeze_last_layer=1, **HEAD, **overrides)  # fmt: skip


def run(out_dir: Path, case: str, strategy: str) -> dict:
    from ssl_xcit.data.datasets import collate_train

    model = build(case)
    record, dtype = Record(), ComputeDtype()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                        precision="bf16-mixed" if case == "bf16" else "32-true", enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[record, dtype],
                        use_distributed_sampler=False)  # fmt: skip
    dataset = Crops(CASES[case][2], gram="gram_loss_weight" in CASES[case][3])
    sampler = DistributedSampler(dataset, 2, int(os.environ["RANK"]), shuffle=False, drop_last=True)
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // 2, sampler=sampler, collate_fn=collate_train)
    trainer.fit(model, loader)
    result = {
        "losses": record.losses,
        "centers": torch.stack(record.centers),
        "student": whole_state(model.student),
        "teacher": whole_state(model.teacher),
        "gram": whole_state(model.gram_teacher) if model.gram_teacher is not None else {},
        "param_types": sorted({type(p).__name__ for p in model.parameters()}),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "global_step": trainer.global_step,
        "compute_dtypes": sorted(dtype.seen),
    }
    path = out_dir / case / strategy
    path.mkdir(parents=True, exist_ok=True)
    torch.save(result, path / f"rank{trainer.global_rank}.pt")
    return result


if __name__ == "__main__":
    for case in sys.argv[2].split(","):
        for strategy in ("ddp", "fsdp2"):
            run(Path(sys.argv[1]), case, strategy)
