"""A tiny DINO run for the DDP agreement test: ``python ddp_worker.py OUT_DIR WORLD_SIZE [MODE[,MODE...]]``
(modes: plain, the default; empty; ibot; distill; init_from; rankme; high_res; ``fsdp2:MODE`` trains MODE
under FSDP2).

Run under ``torchrun --nproc_per_node 2`` it is a real 2-process Lightning DDP run on CPU (gloo); with
WORLD_SIZE 1 it is the single-process reference on the same global batch (8 images per step).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

GLOBAL_BATCH = 8
STEPS = 2


class FixedCrops(Dataset):
    """Deterministic crops (no RNG), so both runs see identical pixels. With ``unreadable``, those indices
    stand for files that failed to decode (``None``, as ``ImageDataset`` returns)."""

    def __init__(self, unreadable: frozenset[int] = frozenset()) -> None:
        self.unreadable = unreadable

    def __len__(self) -> int:
        return GLOBAL_BATCH * STEPS

    def __getitem__(self, i: int):
        if i in self.unreadable:
            return None
        g = torch.Generator().manual_seed(1000 + i)
        crops = [torch.randn(3, s, s, generator=g) + (i % 3) for s in (16, 16, 8, 8)]
        return crops, i % 3, i


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses, self.centers, self.indices = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is None:  # a skipped batch
            return
        self.losses.append(float(loss))
        self.indices.append(batch[2].tolist())
        self.centers.append(pl_module.dino_loss.center.detach().clone())


class HeldOut(Dataset):
    """7 unlabelled held-out images for the RankMe monitor; image 4 is unreadable (``None``)."""

    def __len__(self) -> int:
        return 7

    def __getitem__(self, i: int):
        return None if i == 4 else (held_out_image(i), -1)


def held_out_image(i: int) -> torch.Tensor:
    return torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(2000 + i)) + i % 2


class WithHeldOut(L.LightningDataModule):
    def __init__(self, loader: DataLoader) -> None:
        super().__init__()
        self.loader = loader

    def train_dataloader(self) -> DataLoader:
        return self.loader

    def heldout_dataset(self) -> Dataset:
        return HeldOut()


def build(**overrides):
    from ssl_xcit.dino.module import DINO

    L.seed_everything(0, verbose=False)
    return DINO(
        **overrides,
        backbone="xcit_nano_12_p8",
        backbone_kwargs={"depth": 1},
        drop_path_rate=0.0,  # random masks would differ between the runs
        out_dim=32,
        head_hidden_dim=32,
        head_bottleneck_dim=16,
        warmup_epochs=0,
        # SGD: AdamW's division by sqrt(v) turns float noise on near-zero gradients into full-size steps,
        # which would hide real disagreements behind a loose tolerance.
        optimizer="sgd",
        lr=2.0,
        freeze_last_layer=0,
    )


def source_file(out_dir: str | Path) -> Path:
    """A backbone file (ViT-Ti with 8-px patches, one block, seed 7) for the teacher and init_from modes. Each process writes
    its own copy with the same tensors, so no rank reads a file another is writing."""
    from ssl_xcit.models import create_model

    torch.manual_seed(7)
    backbone = create_model("vit_tiny_patch16_224", depth=1, patch_size=8)
    hyper = {"backbone": "vit_tiny_patch16_224", "backbone_kwargs": {"depth": 1, "patch_size": 8}}
    path = Path(out_dir) / f"source_{os.environ.get('RANK', 'single')}.pth"
    torch.save({"state_dict": backbone.state_dict(), "hyper_parameters": hyper}, path)
    return path


def build_distill(teacher: Path):
    from ssl_xcit.dino.distill import Distill

    L.seed_everything(0, verbose=False)
    return Distill(teacher=str(teacher), backbone="xcit_nano_12_p8", backbone_kwargs={"depth": 1},
                   drop_path_rate=0.0, out_dim=32, head_hidden_dim=32, head_bottleneck_dim=16, warmup_epochs=0,
                   optimizer="sgd", lr=2.0, freeze_last_layer=0)  # fmt: skip


def build_init_from(source: Path):
    """A ViT-Ti/8 DINO run started from ``source``: its default head warm-up (the backbone waits 50 steps)."""
    from ssl_xcit.dino.module import DINO

    L.seed_everything(0, verbose=False)
    return DINO("vit_tiny_patch16_224", backbone_kwargs={"depth": 1, "patch_size": 8}, init_from=str(source),
                drop_path_rate=0.0, out_dim=32, head_hidden_dim=32, head_bottleneck_dim=16, warmup_epochs=0,
                optimizer="sgd", lr=2.0, freeze_last_layer=0)  # fmt: skip


def initial_student() -> dict:
    return {k: v.clone() for k, v in build().student.state_dict().items()}


def run(
    out_dir: str | Path,
    world_size: int,
    empty_first_batch_on_rank1: bool = False,
    ibot: bool = False,
    distill: bool = False,
    init_from: bool = False,
    rankme: bool = False,
    strategy: str = "ddp",
) -> dict:
    """With ``empty_first_batch_on_rank1`` every image of rank 1's first batch is unreadable; ``ibot`` adds the
    masked patch term with Sinkhorn-Knopp centring (all-reduced over the masked patches of both ranks);
    ``distill`` trains an XCiT student against a frozen ViT teacher (the features objective); ``init_from``
    starts a ViT from a backbone file, with the fresh head warming up alone; ``rankme`` adds two RankMe
    monitors on ``HeldOut``: all 7 images (ranks 0 and 1 embed 0-3 and 5-6) and 3 of them (0, 2 and 4: rank 1's
    only image is unreadable, so it sends zeros). ``strategy``: the 2-process
    strategy (``ddp`` or ``fsdp2``, whose sharded tensors are gathered whole into the result)."""
    from ssl_xcit.data.datasets import collate_train
    from ssl_xcit.trainer.rankme import RankMe

    if distill:
        model = build_distill(source_file(out_dir))
    elif init_from:
        model = build_init_from(source_file(out_dir))
    else:
        model = build(ibot_loss_weight=1.0, centering="sinkhorn_knopp") if ibot else build()
    record = Record()
    monitors = [RankMe(max_images=7, batch_size=2), RankMe(max_images=3, batch_size=2)] if rankme else []
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        num_nodes=1,
        strategy=strategy if world_size > 1 else "auto",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record, *monitors],
        # Lightning's own sampler shuffles; an unshuffled one makes the union of the ranks' batches equal
        # the single-process batch (rank r gets samples r, r + 2, ...).
        use_distributed_sampler=False,
    )
    # Unshuffled DistributedSampler: rank 1's first batch is samples 1, 3, 5, 7.
    dataset = FixedCrops(frozenset({1, 3, 5, 7}) if empty_first_batch_on_rank1 else frozenset())
    sampler = None
    if world_size > 1:
        sampler = DistributedSampler(
            dataset, world_size, int(os.environ["RANK"]), shuffle=False, drop_last=True
        )
    loader = DataLoader(
        dataset,
        batch_size=GLOBAL_BATCH // world_size,
        sampler=sampler,
        drop_last=True,
        collate_fn=collate_train,
    )
    trainer.fit(model, datamodule=WithHeldOut(loader)) if rankme else trainer.fit(model, loader)
    if strategy == "fsdp2" and world_size > 1:  # the sharded checkpoint of the run's end, for its readers
        trainer.save_checkpoint(Path(out_dir) / "last.ckpt")
    result = {
        "losses": record.losses,
        "indices": record.indices,
        "centers": torch.stack(record.centers),
        "student": whole_state(model.student),
        "teacher": whole_state(model.teacher),
        "bn_types": sorted({type(m).__name__ for m in model.modules() if "Norm" in type(m).__name__}),
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "skipped_batches": model.skipped_batches,
        "rankme": [m.history for m in monitors],
        "sharded": sorted({type(p).__name__ for p in model.student.parameters()}),
    }
    torch.save(result, Path(out_dir) / f"rank{trainer.global_rank}_of{world_size}.pt")
    return result


def run_high_res(out_dir: str | Path, world_size: int) -> dict:
    """DINODataModule with a high-resolution last epoch (16/8-px crops, then 32/16) on 16 images of a folder each
    rank writes for itself: every rank's batches switch size at the same step."""
    from PIL import Image

    from ssl_xcit.data.datamodule import DINODataModule

    folder = Path(out_dir) / f"images_{os.environ.get('RANK', 'single')}"
    for c in range(2):
        (folder / f"c{c}").mkdir(parents=True, exist_ok=True)
        for i in range(8):
            pixels = torch.rand(24, 24, 3, generator=torch.Generator().manual_seed(100 * c + i)) * 255
            Image.fromarray(pixels.byte().numpy()).save(folder / f"c{c}" / f"{i}.png")
    sizes = []

    class Sizes(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            sizes.append((trainer.global_step, batch[0][0].shape[-1], batch[0][-1].shape[-1]))

    data = DINODataModule(root=str(folder), batch_size=4, num_workers=0, persistent_workers=False,
                          pin_memory=False, global_crops_size=16, local_crops_size=8, local_crops_number=1,
                          high_res_epochs=1, high_res_crops_size=(32, 16))  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy="ddp" if world_size > 1 else "auto",
                        max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Sizes()])  # fmt: skip
    trainer.fit(build(), datamodule=data)
    result = {"sizes": sizes, "global_step": trainer.global_step}
    torch.save(result, Path(out_dir) / f"rank{trainer.global_rank}_of{world_size}.pt")
    return result


def whole_state(network: torch.nn.Module) -> dict:
    """``network``'s state dict as whole tensors (FSDP2's shards gathered; every rank takes part)."""
    from ssl_xcit.parallel.fsdp import whole_state_dict

    return whole_state_dict(network)


MODES = {
    "plain": {},
    "empty": {"empty_first_batch_on_rank1": True},
    "ibot": {"ibot": True},
    "distill": {"distill": True},
    "init_from": {"init_from": True},
    "rankme": {"rankme": True},
}

if __name__ == "__main__":
    # MODES may list several, comma-separated, each written to OUT_DIR/<mode>: they run one after another in
    # the same processes, since starting torchrun and importing torch and Lightning costs more than a run.
    # A mode may name its 2-process strategy, ``fsdp2:plain`` (default ddp), written to OUT_DIR/fsdp2-plain.
    for spec in sys.argv[3].split(",") if len(sys.argv) > 3 else ["plain"]:
        strategy, _, mode = spec.rpartition(":")
        out = Path(sys.argv[1]) / spec.replace(":", "-")
        out.mkdir(parents=True, exist_ok=True)
        if mode == "high_res":
            run_high_res(out, int(sys.argv[2]))
        else:
            run(out, int(sys.argv[2]), **MODES[mode], strategy=strategy or "ddp")
