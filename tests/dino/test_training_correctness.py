"""Defects that silently degrade training: modes, schedule sizing, accumulation leaks (review, issue 12)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from conftest import RandomCrops
from torch.utils.data import DataLoader

from ssl_xcit.data.datasets import collate_skip_none, collate_train
from ssl_xcit.dino.schedules import scaled_lr


class ModeProbe(L.Callback):
    """Records, at every training batch, whether any student or teacher submodule is in eval mode."""

    def __init__(self) -> None:
        self.eval_modules: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        mods = [*pl_module.student.modules(), *pl_module.teacher.modules()]
        self.eval_modules.append(sum(not m.training for m in mods))


class EvalAtEpochEnd(L.Callback):
    """A careless callback that leaves the teacher's backbone in eval mode after each epoch."""

    def on_train_epoch_end(self, trainer, pl_module):
        pl_module.teacher.backbone.eval()


@pytest.mark.parametrize("before_fit", ["model.eval", "teacher.eval", "callback"])
def test_student_and_teacher_train_in_train_mode(tiny, tmp_path, before_fit):
    L.seed_everything(0)
    model = tiny.model()
    probe = ModeProbe()
    callbacks = [probe]
    if before_fit == "model.eval":
        model.eval()
    elif before_fit == "teacher.eval":
        model.teacher.backbone.eval()
    else:
        callbacks.append(EvalAtEpochEnd())
    trainer = tiny.trainer(tmp_path, max_epochs=2, callbacks=callbacks)
    trainer.fit(model, tiny.loader())
    assert len(probe.eval_modules) == 8
    assert probe.eval_modules == [0] * 8


class DropFirstImages(RandomCrops):
    """Items 0 and 1 are unreadable (None), so the first unshuffled batch of 4 holds only 2 images."""

    def __getitem__(self, i):
        return None if i < 2 else super().__getitem__(i)


def test_lr_schedule_sized_from_configured_batch_not_first_batch(tiny, tmp_path):
    L.seed_everything(0)
    model = tiny.model(lr=0.02, min_lr=0.0)
    loader = DataLoader(DropFirstImages(16), batch_size=4, shuffle=False, collate_fn=collate_skip_none)
    trainer = tiny.trainer(tmp_path, max_epochs=2)
    trainer.fit(model, loader)
    assert float(model.schedules.lr.max()) == pytest.approx(scaled_lr(0.02, 4), rel=1e-9)


def test_all_unreadable_batch_is_skipped_and_counted(tiny, tmp_path):
    class AllBadFirstBatch(RandomCrops):
        def __getitem__(self, i):
            return None if i < 4 else super().__getitem__(i)

    L.seed_everything(0)
    model = tiny.model()
    loader = DataLoader(AllBadFirstBatch(16), batch_size=4, shuffle=False, collate_fn=collate_train)
    trainer = tiny.trainer(tmp_path, max_epochs=1)
    trainer.fit(model, loader)
    assert model.skipped_batches == 1
    assert trainer.global_step == 3


class GradAndForwardProbe(L.Callback):
    def __init__(self) -> None:
        self.grads_at_epoch_start: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.grads_at_epoch_start.append(any(p.grad is not None for p in pl_module.student.parameters()))


def test_accumulation_tail_does_not_leak_into_next_epoch(tiny, tmp_path):
    """3 batches per epoch with 2 per step: the third cannot fill a step and must not reach the next one."""
    L.seed_everything(0)
    model = tiny.model(accumulate_grad_batches=2)
    calls = []
    model.student.register_forward_hook(lambda *_: calls.append(1))
    probe = GradAndForwardProbe()
    trainer = tiny.trainer(tmp_path, max_epochs=2, callbacks=[probe])
    trainer.fit(model, tiny.loader(n=12, batch_size=4))
    assert trainer.global_step == 2
    assert probe.grads_at_epoch_start == [False, False]
    assert len(calls) == 4  # the tail batch of each epoch is dropped, not computed
    assert torch.isfinite(model.dino_loss.center).all()


def test_skipped_batches_are_logged(tiny, tmp_path):
    class AllBadFirstBatch(RandomCrops):
        def __getitem__(self, i):
            return None if i < 4 else super().__getitem__(i)

    L.seed_everything(0)
    model = tiny.model()
    loader = DataLoader(AllBadFirstBatch(16), batch_size=4, shuffle=False, collate_fn=collate_train)
    trainer = tiny.trainer(tmp_path, max_epochs=1)
    trainer.fit(model, loader)
    assert float(trainer.callback_metrics["train/skipped_batches"]) == 1.0
