"""Which photometric augmentations training and validation draw: ``python augment_worker.py ROOT OUT SCENARIO``.

Every image of ``ROOT`` (see :func:`make_identical_images`) is the same flat colour, so every crop of it is the
same whatever the geometry: a batch's augmented crops depend on the photometric parameters alone. A probe
module records, per batch, each sample's mean colour after the device augmentation.

- ``resume`` (under ``torchrun --nproc_per_node 2``, gloo): one epoch with a checkpoint, a resumed second
  epoch, and an uninterrupted two-epoch run; saves ``OUT/resume_rank<R>.pt``.
- ``validation`` (one process): two epochs with a validation pass (and a sanity check) before and after each,
  and the same without validation; returns the records.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from PIL import Image

from ssl_xcit.data.datamodule import DINODataModule

PER_CLASS = 8


def make_identical_images(root: Path) -> Path:
    """An ImageFolder tree of 2 classes x ``PER_CLASS`` identical flat-colour PNGs (lossless: truly flat)."""
    for name in ("a", "b"):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(PER_CLASS):
            Image.new("RGB", (24, 24), (180, 100, 60)).save(root / name / f"{i}.png")
    return root


class Probe(L.LightningModule):
    """Records ``[crop][sample] -> mean colour`` of every training and validation batch it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.train_draws: dict[tuple[int, int], torch.Tensor] = {}
        self.val_draws: list[list[torch.Tensor]] = []

    @staticmethod
    def colours(batch) -> torch.Tensor:
        return torch.stack([c.float().mean((2, 3)) for c in batch[0]]).detach().cpu()

    def training_step(self, batch, batch_idx):
        self.train_draws[(self.current_epoch, batch_idx)] = self.colours(batch)
        return (self.weight * batch[0][0].float().mean()).sum()

    def on_validation_epoch_start(self) -> None:
        self.val_draws.append([])

    def validation_step(self, batch, batch_idx):
        self.val_draws[-1].append(self.colours(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(
    root: Path, out: Path, world_size: int, max_epochs: int, ckpt_path=None, validate=False, hold_out=False
) -> Probe:
    """``hold_out``: keep a quarter of the images out of training (the val set); ``validate``: run the
    validation passes on it."""
    L.seed_everything(0, verbose=False)
    dm = DINODataModule(
        root=str(root), batch_size=2, num_workers=0, persistent_workers=False, global_crops_size=16,
        local_crops_size=8, local_crops_number=2, augment_on="device", val_fraction=0.25 if hold_out else 0.0,
    )  # fmt: skip
    probe = Probe()
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy="ddp" if world_size > 1 else "auto",
        max_epochs=max_epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=2 if validate else 0, limit_val_batches=None if validate else 0,
        callbacks=[ModelCheckpoint(dirpath=out / "ckpt", save_last=True)], default_root_dir=out,
    )  # fmt: skip
    trainer.fit(probe, dm, ckpt_path=ckpt_path)
    return probe


def resume(root: Path, out: Path) -> None:
    first = fit(root, out / "first", 2, max_epochs=1)
    resumed = fit(root, out / "first", 2, max_epochs=2, ckpt_path=str(out / "first" / "ckpt" / "last.ckpt"))
    full = fit(root, out / "full", 2, max_epochs=2)
    draws = {"first": first.train_draws, "resumed": resumed.train_draws, "full": full.train_draws}
    torch.save(draws, out / f"resume_rank{os.environ['RANK']}.pt")


def validation(root: Path, out: Path) -> dict:
    with_val = fit(root, out / "with_val", 1, max_epochs=2, validate=True, hold_out=True)
    without = fit(root, out / "without", 1, max_epochs=2, hold_out=True)
    return {"with_val": with_val, "without": without}


if __name__ == "__main__":
    root, out, scenario = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    np.seterr(all="ignore")
    {"resume": resume}[scenario](root, out)
