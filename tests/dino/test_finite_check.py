"""A non-finite loss stops the run with the step it happened: read on the host every sync_every_n_steps steps
(a device flag in between, no sync per step), and always before a checkpoint is written."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from conftest import RandomCrops
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from ssl_xcit.errors import TrainingDiverged


class NaNFrom(RandomCrops):
    """Crops of NaN from item ``start`` on (batch size 4: from batch ``start // 4``)."""

    def __init__(self, start: int) -> None:
        super().__init__(16)
        self.start = start

    def __getitem__(self, i: int):
        crops, label, index = super().__getitem__(i)
        if i >= self.start:
            crops = [torch.full_like(c, float("nan")) for c in crops]
        return crops, label, index


def _trainer(tmp_path, callbacks=()) -> L.Trainer:
    return L.Trainer(
        max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks), default_root_dir=tmp_path,
    )  # fmt: skip


def test_nan_is_read_every_k_steps_and_names_its_step(tiny, tmp_path):
    L.seed_everything(0)
    model = tiny.model(sync_every_n_steps=3)
    reads = []
    real_read = model._finite.read
    model._finite.read = lambda gather: reads.append(model.global_step) or real_read(gather)
    trainer = _trainer(tmp_path)
    with pytest.raises(
        TrainingDiverged,
        match=r"DINO loss is nan at global step 1 \(epoch 0; found by the check of steps 0-2, "
        r"sync_every_n_steps=3\).*Last good checkpoint: none saved yet",
    ):
        trainer.fit(model, DataLoader(NaNFrom(4), batch_size=4, shuffle=False))
    assert reads == [3]  # one host read for three steps: steps 0-2, after the third optimiser step


def test_no_checkpoint_is_written_after_a_nan(tiny, tmp_path):
    """A checkpoint every step, a read every 50: the save after the NaN step reads first and stops the run;
    the error names the last checkpoint written, from before the NaN."""
    L.seed_everything(0)
    model = tiny.model(sync_every_n_steps=50)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    trainer = _trainer(tmp_path, [ckpt])
    with pytest.raises(TrainingDiverged, match=r"at global step 2 .*Last good checkpoint: .*step=2\.ckpt"):
        trainer.fit(model, DataLoader(NaNFrom(8), batch_size=4, shuffle=False))
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt"))
    assert saved == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]
    for path in saved:
        state = torch.load(tmp_path / "ckpt" / path, weights_only=False)["state_dict"]
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


class NaNGradients(L.Callback):
    """A finite loss whose gradients are NaN: a hook on one student weight, as XCA's float16 backward gave."""

    def on_train_start(self, trainer, pl_module) -> None:
        weight = next(p for p in pl_module.student.parameters() if p.requires_grad)
        weight.register_hook(lambda grad: grad * float("nan"))


def _fp16_trainer(tmp_path, callbacks) -> L.Trainer:
    """16-mixed with a real GradScaler on the CPU (Lightning's CPU flag would turn 16-mixed into bf16)."""
    from lightning.pytorch.plugins import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    return L.Trainer(
        max_epochs=3, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=False,
        callbacks=list(callbacks), default_root_dir=tmp_path, plugins=[plugin],
    )  # fmt: skip


def test_a_gradscaler_that_skips_every_step_stops_the_run(tiny, tmp_path):
    """Every step skipped (NaN gradients, finite loss): the scale halves from 65536 at each step, and the first
    read after it falls below 1 stops the run; before the check the run ended normally with unmoved weights."""
    L.seed_everything(0)
    model = tiny.model(sync_every_n_steps=5)
    before = [p.detach().clone() for p in model.student.parameters()]
    trainer = _fp16_trainer(tmp_path, [NaNGradients()])
    with pytest.raises(
        TrainingDiverged,
        match=r"16-mixed: the GradScaler skipped optimiser steps until its loss scale fell to 0\.0625 \(below 1\) "
        r"by global step 20 .*loss stayed finite \(\d.*bf16-mixed or 32",
    ):
        trainer.fit(model, DataLoader(RandomCrops(40), batch_size=4, shuffle=False))
    # the reads at steps 5, 10, 15 and 20 see 2^11, 2^6, 2^1 and 2^-4: the first below 1 is step 20's
    assert trainer.precision_plugin.scaler.get_scale() == 2.0**-4
    assert all(torch.equal(a, b) for a, b in zip(before, model.student.parameters(), strict=True))


def test_a_gradscaler_run_with_finite_gradients_trains_on(tiny, tmp_path):
    L.seed_everything(0)
    model = tiny.model(sync_every_n_steps=5)
    trainer = _fp16_trainer(tmp_path, [])
    trainer.fit(model, DataLoader(RandomCrops(40), batch_size=4, shuffle=False))
    assert trainer.global_step == 30 and trainer.precision_plugin.scaler.get_scale() >= 1.0
