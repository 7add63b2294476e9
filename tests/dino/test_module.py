from __future__ import annotations

import copy
import math

import lightning as L
import pytest
import torch

from ssl_xcit.trainer.checkpointing import AtomicCheckpointIO


def _fit(tiny, tmp_path, callbacks=(), ckpt_path=None, max_epochs=2, **model_kw):
    L.seed_everything(0)
    model = tiny.model(**model_kw)
    trainer = tiny.trainer(tmp_path, max_epochs=max_epochs, callbacks=callbacks)
    trainer.fit(model, tiny.loader(), ckpt_path=ckpt_path)
    return model, trainer


def test_resume_at_epoch_boundary_is_exact_and_last_layer_frozen_in_epoch_0(tiny, tmp_path):
    rec = tiny.Recorder()
    full, trainer = _fit(tiny, tmp_path / "full", [rec])
    assert trainer.global_step == 8
    # last layer: untouched during epoch 0 (freeze_last_layer=1), updated in epoch 1
    assert torch.equal(rec.last_layer[("start", 0)], rec.last_layer[("end", 0)])
    assert not torch.equal(rec.last_layer[("start", 1)], rec.last_layer[("end", 1)])
    # the rest of the student did change in epoch 0
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)

    _fit(tiny, tmp_path / "resumed", [tiny.Recorder(stop_after_epoch=0)])
    last = tmp_path / "resumed" / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=True)["epoch"] == 0
    resumed, trainer2 = _fit(tiny, tmp_path / "resumed", ckpt_path=str(last))
    assert trainer2.global_step == 8
    a, b = full.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key  # bit-exact, teacher, student and centre alike
    # optimizer state as well
    sa, sb = trainer.optimizers[0].state_dict()["state"], trainer2.optimizers[0].state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa)


def test_a_few_steps_reduce_the_loss(tiny, tmp_path):
    rec = tiny.Recorder()
    # One fixed batch, seen over and over: the student must move towards the (slow) teacher.
    L.seed_everything(0)
    model = tiny.model(
        drop_path_rate=0.0, warmup_epochs=0, lr=0.05, freeze_last_layer=0, momentum_teacher=0.999
    )
    trainer = tiny.trainer(tmp_path, max_epochs=12, callbacks=[rec])
    trainer.fit(model, tiny.loader(n=8, batch_size=8, shuffle=False, noise=False))
    assert rec.losses[-1] < 0.8 * rec.losses[0], rec.losses


def test_ema_update_math(tiny):
    model = tiny.model()
    with torch.no_grad():
        for p in model.student.parameters():
            p.add_(torch.randn_like(p))
    teacher_before = copy.deepcopy(model.teacher.state_dict())
    student = model.student.state_dict()
    model._update_teacher(0.9)
    after = model.teacher.state_dict()
    param_names = {n for n, _ in model.teacher.named_parameters()}
    for name, value in after.items():
        if name in param_names:
            torch.testing.assert_close(value, 0.9 * teacher_before[name] + 0.1 * student[name])
        else:  # buffers (BN running stats) are not averaged
            assert torch.equal(value, teacher_before[name]), name


def test_teacher_is_a_frozen_copy_with_the_modules_mode(tiny):
    model = tiny.model()
    s, t = model.student.state_dict(), model.teacher.state_dict()
    assert all(torch.equal(s[k], t[k]) for k in s)
    assert not any(p.requires_grad for p in model.teacher.parameters())
    student_dp = [m.drop_prob for m in model.student.modules() if type(m).__name__ == "DropPath"]
    teacher_dp = [m.drop_prob for m in model.teacher.modules() if type(m).__name__ == "DropPath"]
    assert student_dp and all(p == pytest.approx(0.1) for p in student_dp)  # drop path: student only
    assert all(p == 0 for p in teacher_dp)
    model.eval()
    assert not any(m.training for m in model.modules())
    model.train()
    assert all(m.training for m in model.modules())


def test_forward_in_eval_mode_is_batch_independent_and_keeps_bn_statistics(tiny):
    """The exported network after ``eval()``: an image embeds the same alone or in a batch, and a forward
    pass (predict, export checks) leaves the teacher's BatchNorm running statistics where they were."""
    torch.manual_seed(0)
    model = tiny.model()
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.teacher.modules())  # XCiT's patch embed
    model.eval()
    buffers = {k: v.clone() for k, v in model.teacher.state_dict().items() if "running" in k}
    x = torch.randn(4, 3, 16, 16) * 3 + 1
    with torch.no_grad():
        batched, alone = model(x), model(x[:1])
    torch.testing.assert_close(batched[:1], alone, rtol=1e-5, atol=1e-6)
    for key, value in buffers.items():
        assert torch.equal(model.teacher.state_dict()[key], value), key


def test_accumulation_longer_than_an_epoch_is_an_error_naming_both_numbers(tiny, tmp_path):
    model = tiny.model(accumulate_grad_batches=5)
    trainer = tiny.trainer(tmp_path, max_epochs=1)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=5 is more than the 4 training batches"):
        trainer.fit(model, tiny.loader(16, batch_size=4))


def test_student_batches_crops_by_resolution(tiny):
    model = tiny.model()
    calls = []
    handle = model.student.backbone.register_forward_hook(lambda m, i, o: calls.append(tuple(i[0].shape)))
    crops = [torch.randn(3, 3, 16, 16)] * 2 + [torch.randn(3, 3, 8, 8)] * 4
    out = model.student(crops)
    handle.remove()
    assert calls == [(6, 3, 16, 16), (12, 3, 8, 8)]
    assert out.shape == (18, 64)


class _PoisonAt(L.Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            with torch.no_grad():
                pl_module.student.backbone.cls_token.fill_(math.nan)


def test_nan_loss_stops_with_step_and_last_checkpoint(tiny, tmp_path):
    L.seed_everything(0)
    model = tiny.model()
    trainer = tiny.trainer(tmp_path, max_epochs=2, callbacks=[_PoisonAt()])
    with pytest.raises(FloatingPointError) as err:
        trainer.fit(model, tiny.loader())
    message = str(err.value)
    assert "global step 4" in message
    assert str(tmp_path / "ckpt" / "last.ckpt") in message


def test_schedules_follow_global_step_and_batch_scaling(tiny, tmp_path):
    L.seed_everything(0)
    model = tiny.model(lr=0.0005, warmup_epochs=1, weight_decay=0.04, weight_decay_end=0.4)
    trainer = tiny.trainer(tmp_path, max_epochs=2)
    trainer.fit(model, tiny.loader(batch_size=4))
    # total batch 4 -> peak lr 0.0005 * 4 / 256; 2 epochs x 4 steps
    assert model.schedules.lr.shape == (8,)
    assert model.schedules.lr[3] == pytest.approx(0.0005 * 4 / 256)
    opt = trainer.optimizers[0]
    assert opt.param_groups[0]["lr"] == pytest.approx(model.schedules.lr[7])
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(model.schedules.weight_decay[7])
    assert opt.param_groups[1]["weight_decay"] == 0.0
    assert model.schedules.momentum[0] == pytest.approx(0.996)


def test_bad_arguments_are_named(tiny):
    with pytest.raises(ValueError, match="unknown model 'xcit_bogus'"):
        tiny.model(backbone="xcit_bogus")
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        tiny.model(accumulate_grad_batches=0)


def test_single_view_training_batches_are_a_named_error_not_a_skip(tiny, tmp_path):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from ssl_xcit.errors import UserError

    L.seed_everything(0)
    loader = DataLoader(TensorDataset(torch.randn(8, 3, 16, 16)), batch_size=4)
    with pytest.raises(UserError, match=r"at least 2 \(global\) crops per image, got 1"):
        tiny.trainer(tmp_path, max_epochs=1).fit(tiny.model(), loader)
