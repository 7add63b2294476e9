"""DINOv3's heads and checkpoints (issue 53): the plain trainable last layer, Meta's training checkpoints as
teachers and sources, ``init_from_ema``, and a ConvNeXt student distilled with iBOT at 2x the teacher's
resolution. The references are DINOv3's own code: dinov3/layers/dino_head.py (the head),
dinov3/train/ssl_meta_arch.py (the ``student``/``teacher`` ModuleDicts and their ``dino_head``/``ibot_head``),
dinov3/checkpointer/checkpointer.py (a DCP of ``{"model": ..., "optimizer": ...}``), dinov3/train/train.py (the
eval ``teacher_checkpoint.pth``) and dinov3/train/multidist_meta_arch.py (the teacher-to-student downsampling)."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ssl_xcit.dino.distill import Distill
from ssl_xcit.dino.head import DINOHead
from ssl_xcit.dino.ibot import MaskedPatches
from ssl_xcit.dino.init_from import apply_weights, read_source, start_from_source
from ssl_xcit.dino.module import DINO
from ssl_xcit.errors import UserError

TINY = dict(backbone="xcit_nano_12_p8", backbone_kwargs={"depth": 1})
HEAD = dict(out_dim=64, head_hidden_dim=32, head_bottleneck_dim=16)


def _reference_head(in_dim: int, out_dim: int, hidden: int, bottleneck: int) -> tuple[nn.Module, nn.Linear]:
    """DINOv3's DINOHead, written from dinov3/layers/dino_head.py: a 3-layer MLP with biases, a bias-free
    plain last layer, every Linear trunc-normal 0.02 and zero bias (``init_weights`` applied to the whole
    head, the MLP's layers first, then the last layer)."""
    mlp = nn.Sequential(
        nn.Linear(in_dim, hidden),
        nn.GELU(),
        nn.Linear(hidden, hidden),
        nn.GELU(),
        nn.Linear(hidden, bottleneck),
    )
    last = nn.Linear(bottleneck, out_dim, bias=False)
    for layer in [*mlp, last]:
        if isinstance(layer, nn.Linear):
            nn.init.trunc_normal_(layer.weight, std=0.02)
            if layer.bias is not None:
                nn.init.constant_(layer.bias, 0)
    return mlp, last


def test_plain_last_layer_is_dinov3s_head():
    """Before: no such layer (DINO's weight norm, frozen at 1 under norm_last_layer)."""
    torch.manual_seed(0)
    head = DINOHead(12, 40, hidden_dim=24, bottleneck_dim=8, last_layer="linear")
    torch.manual_seed(0)
    mlp, last = _reference_head(12, 40, 24, 8)
    want = {f"mlp.{k}": v for k, v in mlp.state_dict().items()} | {"last_layer.weight": last.weight}
    assert set(head.state_dict()) == set(want)
    for key, value in head.state_dict().items():
        assert torch.equal(value, want[key]), key
    assert all(p.requires_grad for p in head.parameters()) and head.out_dim == 40
    x = torch.randn(5, 12)
    torch.testing.assert_close(head(x), last(F.normalize(mlp(x), dim=-1, p=2)))
    with pytest.raises(ValueError, match="last_layer must be one of weight_norm, linear, got 'plain'"):
        DINOHead(12, 40, last_layer="plain")


def test_the_dinov3_objective_gives_the_student_plain_heads(tmp_path):
    """Before: a dinov3 distillation's student head held 4 weight-norm tensors (weight_g, weight_v of both)."""
    torch.manual_seed(1)
    teacher = DINO(**TINY, **HEAD, ibot_loss_weight=1.0, ibot_out_dim=48)
    path = tmp_path / "teacher.ckpt"
    torch.save({"state_dict": teacher.state_dict(), "hyper_parameters": dict(teacher.hparams)}, path)
    model = Distill(teacher=str(path), objective="dinov3", **TINY, head_hidden_dim=32, head_bottleneck_dim=16,
                    ibot_loss_weight=1.0)  # fmt: skip
    for network in (model.student, model.student_ema):
        names = [k for k in network.state_dict() if "weight_g" in k or "weight_v" in k]
        assert names == []
        assert isinstance(network.head.last_layer, nn.Linear) and network.head.out_dim == 64
        assert isinstance(network.patch_head.last_layer, nn.Linear) and network.patch_head.out_dim == 48
    assert model.student.head.last_layer.weight.requires_grad
    dino = Distill(teacher=str(path), objective="dino", **TINY, head_hidden_dim=32, head_bottleneck_dim=16)
    assert hasattr(dino.student.head.last_layer, "weight_v")  # the dino objective keeps DINO's layer
    with pytest.raises(UserError, match="head_last_layer must be one of weight_norm, linear, got 'plain'"):
        DINO(**TINY, **HEAD, head_last_layer="plain")


def _meta_run() -> DINO:
    """A tiny run with DINOv3's plain heads and iBOT, its teacher moved away from its student."""
    torch.manual_seed(2)
    run = DINO(**TINY, **HEAD, ibot_loss_weight=1.0, ibot_out_dim=48, head_last_layer="linear")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in run.teacher.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return run


def _meta_names(network: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """``network``'s state in ssl_meta_arch.py's naming: ``<prefix>.backbone.*``, ``.dino_head.*``, ``.ibot_head.*``."""
    rename = {"backbone": "backbone", "head": "dino_head", "patch_head": "ibot_head"}
    out = {}
    for key, value in network.state_dict().items():
        part, _, rest = key.partition(".")
        out[f"{prefix}{rename[part]}.{rest}"] = value.clone()
    return out


def _equal(got: nn.Module, want: nn.Module) -> bool:
    """The same tensors, but iBOT's mask token, which a frozen teacher's backbone leaves out (training-only)."""
    ref = {k: v for k, v in want.state_dict().items() if not k.endswith("mask_token")}
    own = {k: v for k, v in got.state_dict().items() if not k.endswith("mask_token")}
    return set(ref) == set(own) and all(torch.equal(v, ref[k]) for k, v in own.items())


@pytest.mark.parametrize("layout", ["nested", "flat", "eval"])
def test_metas_training_checkpoints_are_teachers(layout, tmp_path):
    """A gathered DINOv3 training checkpoint (``model`` nested, or flattened to ``model.*`` keys) and an eval
    ``teacher_checkpoint.pth`` are distillation teachers with their heads. Before: "not a DINO head state"."""
    run = _meta_run()
    model_state = _meta_names(run.student, "student.") | _meta_names(run.teacher, "teacher.")
    optimizer = {"state": {"student.backbone.cls_token": {"step": torch.tensor(5.0)}}, "param_groups": []}
    if layout == "nested":
        checkpoint = {"model": model_state, "optimizer": optimizer, "iteration": 5}
    elif layout == "flat":
        checkpoint = {f"model.{k}": v for k, v in model_state.items()} | {"iteration": 5}
    else:
        checkpoint = {"teacher": _meta_names(run.teacher, "")}
    path = tmp_path / "meta.pth"
    torch.save(checkpoint, path)
    distill = Distill(teacher=str(path), objective="dinov3", **TINY, head_hidden_dim=32, head_bottleneck_dim=16,
                      ibot_loss_weight=1.0)  # fmt: skip
    assert _equal(distill.teacher.head, run.teacher.head)
    assert _equal(distill.teacher.patch_head, run.teacher.patch_head)
    assert _equal(distill.teacher.backbone, run.teacher.backbone)
    assert distill.hparams.out_dim == 64 and distill.hparams.ibot_out_dim == 48

    # The same file starts a DINO run with its heads: the student from its student where it has one.
    model = DINO(**TINY, **HEAD, ibot_loss_weight=1.0, ibot_out_dim=48, head_last_layer="linear")
    loaded = apply_weights(model, read_source(str(path)))
    assert loaded["head"] and loaded["patch_head"]
    assert _equal(model.teacher, run.teacher)
    assert _equal(model.student, run.teacher if layout == "eval" else run.student)
    # DINO's weight-normalised heads cannot take a plain layer: one line naming the setting.
    with pytest.raises(UserError, match="head_last_layer") as error:
        apply_weights(DINO(**TINY, **HEAD, ibot_loss_weight=1.0, ibot_out_dim=48), read_source(str(path)))
    assert "\n" not in str(error.value)


class _Trainer:  # what start_from_source reads of a trainer
    ckpt_path = None


def test_init_from_ema_starts_both_networks_from_the_ema(tmp_path, monkeypatch):
    """DINOv3's resume_from_teacher_chkpt (dinov3/train/ssl_meta_arch.py, init_weights): student and EMA both
    from the teacher. Default: the student from the student."""
    run = _meta_run()
    path = tmp_path / "run.ckpt"
    torch.save({"state_dict": run.state_dict(), "hyper_parameters": dict(run.hparams)}, path)
    for flag, student_source in ((True, run.teacher), (False, run.student)):
        torch.manual_seed(4)
        model = DINO(**TINY, **HEAD, ibot_loss_weight=1.0, ibot_out_dim=48, head_last_layer="linear",
                     init_from=str(path), init_from_ema=flag)  # fmt: skip
        monkeypatch.setattr(DINO, "trainer", _Trainer(), raising=False)
        start_from_source(model)
        assert _equal(model.student, student_source)
        assert _equal(model.teacher, run.teacher)


class _BigCrops(Dataset):
    """2 global crops of 128 px (the teacher's side) and 2 local crops of 32 px."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        crops = [torch.randn(3, s, s, generator=g) for s in (128, 128, 32, 32)]
        return crops, i % 2, i


CONVNEXT = dict(backbone="convnext_tiny", backbone_kwargs={"depths": (1, 1, 1, 1), "dims": (8, 8, 8, 16)},
                drop_path_rate=0.0, head_hidden_dim=32, head_bottleneck_dim=16, ibot_loss_weight=1.0,
                warmup_epochs=0, lr=0.01, min_lr=1e-4, freeze_last_layer=0, koleo_weight=0.1,
                centering="sinkhorn_knopp", warmup_teacher_temp=0.07, teacher_temp=0.07)  # fmt: skip


def test_a_convnext_student_distils_with_ibot_at_half_the_teachers_resolution(tmp_path):
    """Before: refused ("convnext backbones cannot take iBOT's patch masks") though DINOv3 never masks a
    distilled student. The student sees the 128 px global crops at 64 px (the scale 2.0 of DINOv3's ConvNeXt
    configs), its masks are drawn on its own 2x2 grid, and the loss falls on a fixed batch."""
    torch.manual_seed(5)
    teacher = DINO(**TINY, **HEAD, ibot_loss_weight=1.0, ibot_out_dim=48)
    path = tmp_path / "teacher.ckpt"
    torch.save({"state_dict": teacher.state_dict(), "hyper_parameters": dict(teacher.hparams)}, path)
    model = Distill(
        teacher=str(path), objective="dinov3", teacher_to_student_resolution_scale=2.0, **CONVNEXT
    )
    assert isinstance(model.student.head.last_layer, nn.Linear)
    crops = list(next(iter(DataLoader(_BigCrops(), batch_size=4)))[0])
    student = model.student_crops(crops)
    assert [tuple(c.shape[-2:]) for c in student] == [(64, 64), (64, 64), (32, 32), (32, 32)]
    torch.testing.assert_close(  # DINOv3's downsampling: bilinear, antialiased
        student[0], F.interpolate(crops[0], scale_factor=0.5, mode="bilinear", antialias=True)
    )
    masks = model.draw_masks(crops[0], [0, 0, 0, 0])
    assert masks.masks.shape == (8, 4)  # 2 x B crops, the student's 2x2 grid
    fixed = MaskedPatches.from_host(np.tile(np.array([[True, False, False, True]]), (8, 1)))
    opt = torch.optim.AdamW([p for p in model.student.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(6):
        out = model.compute_losses(crops, fixed, 0, update_center=True)
        assert out.ibot is not None
        opt.zero_grad()
        out.total.backward()
        opt.step()
        losses.append(float(out.total.detach()))
    assert losses[-1] < losses[0] - 0.05, losses

    # It trains under Lightning too: 2 optimiser steps, the student moved.
    before = {k: v.clone() for k, v in model.student.backbone.state_dict().items()}
    trainer = L.Trainer(max_epochs=1, limit_train_batches=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(model, DataLoader(_BigCrops(), batch_size=4, drop_last=True))
    assert trainer.global_step == 2
    moved = [k for k, v in model.student.backbone.state_dict().items() if not torch.equal(v, before[k])]
    assert moved


def test_the_resolution_scale_is_checked():
    with pytest.raises(UserError, match="teacher_to_student_resolution_scale must be a positive factor"):
        Distill(teacher="x.ckpt", teacher_to_student_resolution_scale=0.0)
    with pytest.raises(UserError, match="both resize a side"):
        Distill(teacher="x.ckpt", teacher_resolution=64, teacher_to_student_resolution_scale=2.0)
