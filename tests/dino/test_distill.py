"""Distillation from a frozen teacher (ssl_xcit.dino.distill): both objectives, our teacher and timm's, another
architecture and patch size than the student (ViT-Ti/16 -> XCiT-N/8), the frozen teacher, the loss, the readers."""

from __future__ import annotations

import lightning as L
import pytest
import timm
import torch
from safetensors.torch import load_file, save_file

from ssl_xcit.cli.export import teacher_backbone
from ssl_xcit.dino.distill import Distill, align_grid, features_loss
from ssl_xcit.dino.module import DINO
from ssl_xcit.errors import UserError
from ssl_xcit.models.checkpoint import build_backbone

STUDENT = dict(
    backbone="xcit_nano_12_p8",
    backbone_kwargs={"depth": 1},
    head_hidden_dim=32,
    head_bottleneck_dim=16,
    warmup_epochs=0,
    lr=0.02,
    min_lr=1e-4,
    freeze_last_layer=0,
)


def _teacher_ckpt(path, ibot: bool = False):
    """A tiny DINO run of ours (ViT-Ti/16, one block) written as its Lightning checkpoint lays it out."""
    torch.manual_seed(1)
    extra = dict(ibot_loss_weight=1.0, ibot_out_dim=48) if ibot else {}
    dino = DINO("vit_tiny_patch16_224", backbone_kwargs={"depth": 1}, out_dim=64, head_hidden_dim=32,
                head_bottleneck_dim=16, **extra)  # fmt: skip
    torch.save({"state_dict": dino.state_dict(), "hyper_parameters": dict(dino.hparams)}, path)
    return dino


def _timm_file(path, name="vit_tiny_patch16_224"):
    """timm's ImageNet weights as its hub stores them (random values: this machine has no network)."""
    torch.manual_seed(2)
    save_file(timm.create_model(name, num_classes=1000).state_dict(), path)
    return path


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_features_loss_matches_an_independent_formula():
    g = torch.Generator().manual_seed(0)
    s_cls, t_cls = torch.randn(3, 5, generator=g), 4 * torch.randn(3, 5, generator=g) + 2
    s_pat, t_pat = torch.randn(3, 6, 5, generator=g), torch.randn(3, 6, 5, generator=g) - 1

    def reference(student, teacher):
        t = teacher.double()
        mean = t.mean(-1, keepdim=True)
        var = ((t - mean) ** 2).mean(-1, keepdim=True)
        target = (t - mean) / torch.sqrt(var + 1e-5)
        return float(((student.double() - target) ** 2).mean())

    cls, patch = features_loss(s_cls, s_pat, t_cls, t_pat)
    assert float(cls) == pytest.approx(reference(s_cls, t_cls), rel=1e-5)
    assert float(patch) == pytest.approx(reference(s_pat, t_pat), rel=1e-5)


def test_align_grid_is_bilinear_on_a_constructed_grid():
    grid = torch.tensor([[0.0, 1.0], [2.0, 3.0]]).reshape(1, 2, 2, 1)
    ramp = torch.tensor([0.0, 0.25, 0.75, 1.0])  # half-pixel centres, edges clamped
    want = (2 * ramp[:, None] + ramp[None, :]).reshape(1, 4, 4, 1)
    assert torch.allclose(align_grid(grid, (4, 4)), want)
    assert align_grid(grid, (2, 2)) is grid


@pytest.mark.parametrize("objective, ibot", [("features", False), ("dino", False), ("dino", True)])
def test_our_teacher_distils_into_another_architecture_and_stays_frozen(objective, ibot, tmp_path, tiny):
    source = _teacher_ckpt(tmp_path / "teacher.ckpt", ibot=ibot)
    extra = dict(ibot_loss_weight=1.0) if ibot else {}
    model = Distill(teacher=str(tmp_path / "teacher.ckpt"), objective=objective, teacher_resolution=32,
                    **STUDENT, **extra)  # fmt: skip
    teacher_before = _state(model.teacher)
    student_before = _state(model.student)
    assert torch.equal(teacher_before["backbone.pos_embed"], source.teacher.backbone.pos_embed)
    trainer = tiny.trainer(tmp_path, max_epochs=1, limit_train_batches=3)
    trainer.fit(model, tiny.loader(n=12))
    assert trainer.global_step == 3
    after = _state(model.teacher)
    assert all(torch.equal(after[k], v) for k, v in teacher_before.items())  # bit-identical, buffers too
    assert not model.teacher.training and not any(p.requires_grad for p in model.teacher.parameters())
    assert any(not torch.equal(v, model.student.state_dict()[k]) for k, v in student_before.items())
    if objective == "dino":  # the student's heads take the teacher's prototype counts
        assert model.student.head.last_layer.weight_v.shape[0] == 64
        assert not ibot or model.student.patch_head.last_layer.weight_v.shape[0] == 48
    # The checkpoint holds no teacher; every reader takes the student.
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert not any(k.startswith("teacher.") for k in saved["state_dict"])
    want = model.student.backbone.state_dict()
    for backbone in (teacher_backbone(ckpt)[0], build_backbone(ckpt)):  # export; knn/linear/embed/visualize
        assert backbone.name == "xcit_nano_12_p8"
        assert all(torch.equal(v, want[k]) for k, v in backbone.state_dict().items())


def test_timm_teacher_from_a_local_file_trains_the_student(tmp_path, tiny):
    path = _timm_file(tmp_path / "vit.safetensors")
    model = Distill(teacher=f"timm:vit_tiny_patch16_224.augreg_in21k_ft_in1k@{path}", teacher_resolution=32,
                    **STUDENT)  # fmt: skip
    assert (model.teacher.cls_dim, model.teacher.patch_dim) == (192, 192)
    released = timm.create_model("vit_tiny_patch16_224", num_classes=1000)
    released.load_state_dict(load_file(path))
    before = _state(model.teacher.backbone)
    assert torch.equal(before["blocks.0.attn.qkv.weight"], released.blocks[0].attn.qkv.weight)
    trainer = tiny.trainer(tmp_path, max_epochs=1, limit_train_batches=2)
    trainer.fit(model, tiny.loader(n=8))
    assert trainer.global_step == 2
    assert all(torch.equal(v, model.teacher.backbone.state_dict()[k]) for k, v in before.items())


def test_features_objective_learns_a_fixed_batch(tmp_path):
    """A real learning check: 20 AdamW steps on one batch more than halve the feature regression loss."""
    _teacher_ckpt(tmp_path / "teacher.ckpt")
    torch.manual_seed(0)
    model = Distill(teacher=str(tmp_path / "teacher.ckpt"), teacher_resolution=32, **STUDENT)
    crops = [torch.randn(4, 3, 16, 16) for _ in range(2)]
    opt = torch.optim.AdamW(model.student.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        out = model.compute_losses(crops, None, 0, update_center=True)
        opt.zero_grad()
        out.total.backward()
        opt.step()
        losses.append(float(out.total.detach()))
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize(
    "teacher, objective, expected",
    [
        ("{tmp}/missing.ckpt", "features", "file not found"),
        ("timm:vit_tiny_patch16_2244", "features", "timm has no model 'vit_tiny_patch16_2244'"),
        ("timm:resnet18.a1_in1k@{tmp}/resnet.safetensors", "features", "not tokens"),
        ("timm:vit_tiny_patch16_224.augreg_in21k_ft_in1k@{tmp}/vit.safetensors", "dino", "has no DINO head"),
        (None, "features", "--model.teacher is required"),
    ],
    ids=["missing-file", "unknown-timm-name", "no-tokens", "dino-without-head", "no-teacher"],
)
def test_bad_teachers_are_one_line(teacher, objective, expected, tmp_path):
    if teacher and "resnet" in teacher:
        _timm_file(tmp_path / "resnet.safetensors", "resnet18")
    if teacher and "vit.safetensors" in teacher:
        _timm_file(tmp_path / "vit.safetensors")
    source = teacher.format(tmp=tmp_path) if teacher else None
    with pytest.raises(UserError, match=expected) as err:
        Distill(teacher=source, objective=objective, **STUDENT)
    assert "\n" not in str(err.value)


def test_gram_anchoring_is_refused_in_one_line():
    # Refused before the teacher is read: the distillation step has no Gram term to train.
    with pytest.raises(UserError, match="gram_loss_weight does not apply to distillation, got 1.0") as err:
        Distill(teacher="unused.ckpt", objective="features", gram_loss_weight=1.0, **STUDENT)
    assert "\n" not in str(err.value)


def test_features_loss_under_bf16_autocast_is_float32_after_the_networks(tmp_path, monkeypatch):
    """Under bf16-mixed the networks compute in bfloat16; the loss after them must add no rounding of its own:
    its value equals float64's on the very tokens the networks gave (rel 1e-5; one bf16 rounding is 2e-3)."""
    import ssl_xcit.dino.distill as distill_module

    _teacher_ckpt(tmp_path / "teacher.ckpt")
    torch.manual_seed(0)
    model = Distill(teacher=str(tmp_path / "teacher.ckpt"), teacher_resolution=32, **STUDENT)
    seen = []
    original = distill_module.features_loss
    monkeypatch.setattr(distill_module, "features_loss", lambda *a: seen.append(a) or original(*a))
    crops = [torch.randn(4, 3, 16, 16) for _ in range(2)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.compute_losses(crops, None, 0, update_center=True)
    s_cls, s_pat, t_cls, t_pat = seen[0]
    assert s_cls.dtype == s_pat.dtype == torch.bfloat16  # the networks did run in bf16
    assert out.total.dtype == torch.float32

    def reference(student, teacher):
        t = teacher.double()
        target = (t - t.mean(-1, keepdim=True)) / torch.sqrt(t.var(-1, unbiased=False, keepdim=True) + 1e-5)
        return float(((student.double() - target) ** 2).mean())

    cls, patch = out.terms["cls_loss"], out.terms["patch_loss"]
    assert float(cls) == pytest.approx(reference(s_cls, t_cls), rel=1e-5)
    assert float(patch) == pytest.approx(reference(s_pat, t_pat), rel=1e-5)


def test_distillation_trains_under_bf16_mixed_and_resumes_exactly(tmp_path, tiny):
    """bf16-mixed on the CPU trains the student with the teacher untouched; a run resumed from its epoch-1
    checkpoint (the teacher read again from SOURCE) ends with the uninterrupted run's student, bit for bit."""
    _teacher_ckpt(tmp_path / "teacher.ckpt")

    class StopAfterFirstEpoch(L.Callback):  # a run killed after its epoch-1 checkpoint, schedules unchanged
        def on_train_epoch_end(self, trainer, pl_module):
            trainer.should_stop = True

    def fit(folder, epochs, ckpt_path=None, precision="32-true", stop=False):
        torch.manual_seed(0)
        model = Distill(teacher=str(tmp_path / "teacher.ckpt"), teacher_resolution=32, **STUDENT)
        callbacks = [StopAfterFirstEpoch()] if stop else []
        trainer = tiny.trainer(tmp_path / folder, max_epochs=epochs, precision=precision, callbacks=callbacks)
        trainer.fit(model, tiny.loader(n=8, shuffle=False), ckpt_path=ckpt_path)
        return model, trainer

    mixed, trainer = fit("bf16", 1, precision="bf16-mixed")
    assert trainer.global_step == 2
    teacher_file = torch.load(tmp_path / "teacher.ckpt", weights_only=False)["state_dict"]
    for key, value in mixed.teacher.backbone.state_dict().items():
        assert torch.equal(value, teacher_file[f"teacher.backbone.{key}"]), key
    assert all(torch.isfinite(p).all() for p in mixed.student.parameters())

    whole, _ = fit("whole", 2)
    fit("first", 2, stop=True)
    resumed, trainer = fit("resumed", 2, ckpt_path=tmp_path / "first" / "ckpt" / "last.ckpt")
    assert trainer.global_step == 4
    for key, value in whole.student.state_dict().items():
        assert torch.equal(resumed.student.state_dict()[key], value), key


def test_the_student_starts_where_dino_from_random_init_starts_under_one_seed(tmp_path):
    """Reading the teacher draws nothing from the global RNG: a distillation and a DINO run of the same seed
    start from the same student backbone (the comparison of docs/training.md starts both from one point)."""
    _timm_file(tmp_path / "vit.safetensors")
    torch.manual_seed(3)
    dino = DINO(**STUDENT)
    torch.manual_seed(3)
    distill = Distill(teacher=f"timm:vit_tiny_patch16_224.augreg_in21k_ft_in1k@{tmp_path / 'vit.safetensors'}",
                      teacher_resolution=32, **STUDENT)  # fmt: skip
    want = dino.student.backbone.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in distill.student.backbone.state_dict().items())
