"""``init_from`` on the sources a distillation writes (a ``features`` run's, a ``dino`` run's, a ``dinov3`` run's
checkpoint), and on an official full checkpoint whose heads were trained with ``norm_last_layer`` false."""

from __future__ import annotations

import argparse

import pytest
import torch

from ssl_xcit.dino.distill import Distill
from ssl_xcit.dino.init_from import apply_weights, read_source
from ssl_xcit.dino.module import DINO
from ssl_xcit.errors import UserError

HEAD = dict(out_dim=64, head_hidden_dim=32, head_bottleneck_dim=16)
TINY = dict(backbone="xcit_nano_12_p8", backbone_kwargs={"depth": 1})


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory):
    """A tiny DINO run of ours with a separate iBOT head, as its Lightning checkpoint lays it out."""
    torch.manual_seed(1)
    dino = DINO(**TINY, **HEAD, ibot_loss_weight=1.0, ibot_out_dim=48)
    path = tmp_path_factory.mktemp("teacher") / "teacher.ckpt"
    torch.save({"state_dict": dino.state_dict(), "hyper_parameters": dict(dino.hparams)}, path)
    return str(path)


def _distilled_ckpt(path, teacher: str, objective: str, **kwargs) -> Distill:
    """A distillation run whose student (and EMA) moved away from the start, saved as Lightning saves it."""
    torch.manual_seed(2)
    model = Distill(teacher=teacher, objective=objective, head_hidden_dim=32, head_bottleneck_dim=16,
                    **TINY, **kwargs)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad or objective == "dinov3":
                p.add_(torch.randn(p.shape, generator=g))
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}, path)
    return model


def _same(got: torch.nn.Module, want: torch.nn.Module) -> bool:
    """Every tensor of ``got`` equals ``want``'s, but a mask token ``want`` lacks (a dinov3 student is never
    masked and has none; the masked model's token starts fresh)."""
    ref = want.state_dict()
    return all(
        torch.equal(v, ref[k])
        for k, v in got.state_dict().items()
        if k in ref or not k.endswith("mask_token")
    )


def test_a_features_run_is_a_source_its_projections_left_out(tmp_path, teacher_path):
    """Before: refused ("its student head does not fit ... set out_dim, head_hidden_dim"), whatever the
    settings: the projections are no DINO head."""
    run = _distilled_ckpt(tmp_path / "last.ckpt", teacher_path, "features")
    torch.manual_seed(4)
    model = DINO(**TINY, **HEAD)
    fresh = {k: v.clone() for k, v in model.student.head.state_dict().items()}
    loaded = apply_weights(model, read_source(str(tmp_path / "last.ckpt")))
    assert loaded == {"head": False, "patch_head": False, "centres": False}
    assert _same(model.student.backbone, run.student.backbone)
    assert _same(model.teacher.backbone, run.student.backbone)
    assert all(torch.equal(v, fresh[k]) for k, v in model.student.head.state_dict().items())


@pytest.mark.parametrize("objective", ["dino", "dinov3"])
def test_a_dino_distillation_is_a_source_with_its_heads(objective, tmp_path, teacher_path):
    """The student's heads (the teacher's prototype counts) come along; under dinov3 the student EMA, the
    network it evaluates, stands for the teacher."""
    run = _distilled_ckpt(tmp_path / "last.ckpt", teacher_path, objective, ibot_loss_weight=1.0)
    torch.manual_seed(5)
    last_layer = "linear" if objective == "dinov3" else "weight_norm"  # each objective's student heads
    model = DINO(**TINY, **HEAD, ibot_loss_weight=1.0, ibot_out_dim=48, head_last_layer=last_layer)
    loaded = apply_weights(model, read_source(str(tmp_path / "last.ckpt")))
    assert loaded["head"] and loaded["patch_head"]
    assert _same(model.student, run.student)
    stand_in = run.student_ema if objective == "dinov3" else run.student
    assert _same(model.teacher, stand_in)
    if objective == "dinov3":
        assert not _same(model.teacher.backbone, run.student.backbone)


def _official_full(path, norm_last_layer: bool | None) -> DINO:
    torch.manual_seed(6)
    run = DINO(**TINY, **HEAD, norm_last_layer=bool(norm_last_layer))
    with torch.no_grad():
        for side in (run.student, run.teacher) if norm_last_layer is False else ():  # a learnt weight norm
            side.head.last_layer.weight_g.mul_(torch.linspace(0.5, 2.0, 64).unsqueeze(1))
    official = {
        side: {f"module.{k}": v for k, v in getattr(run, side).state_dict().items()}
        for side in ("student", "teacher")
    }
    args = dict(arch="xcit_nano_12_p8", out_dim=64)
    if norm_last_layer is not None:
        args["norm_last_layer"] = norm_last_layer
    official |= {
        "epoch": 300,
        "args": argparse.Namespace(**args),
        "dino_loss": {"center": torch.zeros(1, 64)},
    }
    torch.save(official, path)
    return run


def test_an_official_head_with_a_learnt_norm_needs_the_matching_setting(tmp_path):
    """Before: loaded silently into norm_last_layer true, its learnt norms then frozen."""
    path = tmp_path / "dino_full_checkpoint.pth"
    run = _official_full(path, norm_last_layer=False)
    torch.manual_seed(7)
    frozen_norm = DINO(**TINY, **HEAD)  # norm_last_layer true, the default
    before = {k: v.clone() for k, v in frozen_norm.state_dict().items()}
    with pytest.raises(UserError) as error:
        apply_weights(frozen_norm, read_source(str(path)))
    message = str(error.value)
    assert "\n" not in message and "norm_last_layer false" in message and "--model.norm_last_layer" in message
    assert all(torch.equal(v, before[k]) for k, v in frozen_norm.state_dict().items())  # nothing loaded

    model = DINO(**TINY, **HEAD, norm_last_layer=False)
    assert apply_weights(model, read_source(str(path)))["head"]
    assert _same(model.student.head, run.student.head)
    assert model.student.head.last_layer.weight_g.requires_grad  # its norms go on training


def test_an_official_head_with_a_fixed_norm_loads_either_way(tmp_path):
    path = tmp_path / "dino_full_checkpoint.pth"
    _official_full(path, norm_last_layer=True)
    for setting in (True, False):
        assert apply_weights(DINO(**TINY, **HEAD, norm_last_layer=setting), read_source(str(path)))["head"]
