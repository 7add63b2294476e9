"""The ``dinov3`` distillation objective: its loss against an independent computation (DINOv3's formulas, float64,
an unmasked student), the student EMA (momentum schedule, and what export, build_backbone, learning.py and the
online k-NN read), and a fit that learns a fixed batch."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ssl_xcit.cli.export import teacher_backbone
from ssl_xcit.dino.distill import Distill
from ssl_xcit.dino.ibot import MaskedPatches
from ssl_xcit.dino.module import DINO
from ssl_xcit.dino.student_ema import ema_update_
from ssl_xcit.models.checkpoint import build_backbone
from ssl_xcit.trainer.callbacks import OnlineKNN

TINY = dict(backbone="xcit_nano_12_p8", backbone_kwargs={"depth": 1})
STUDENT = dict(**TINY, head_hidden_dim=32, head_bottleneck_dim=16, warmup_epochs=0, lr=0.02, min_lr=1e-4,
               freeze_last_layer=0, centering="sinkhorn_knopp", warmup_teacher_temp=0.07, teacher_temp=0.07,
               koleo_weight=0.1, ibot_loss_weight=1.0)  # fmt: skip


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory):
    """A tiny DINO run of ours (XCiT-N/8, one block) with a separate iBOT head, as Lightning saves it."""
    torch.manual_seed(1)
    dino = DINO(**TINY, out_dim=64, head_hidden_dim=32, head_bottleneck_dim=16, ibot_loss_weight=1.0,
                ibot_out_dim=48)  # fmt: skip
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():  # a trained-looking teacher: heads far from their initialisation
        for p in dino.teacher.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    path = tmp_path_factory.mktemp("teacher") / "teacher.ckpt"
    torch.save({"state_dict": dino.state_dict(), "hyper_parameters": dict(dino.hparams)}, path)
    return str(path)


def _sinkhorn64(logits: torch.Tensor, temp: float, iterations: int = 3) -> torch.Tensor:
    """DINOv3's ``sinkhorn_knopp_teacher`` (one process), in float64: Q = exp(l / T)^T, normalised to sum 1,
    then rows to 1/K and columns to 1/B alternately; columns rescaled to sum 1."""
    q = torch.exp(logits.double() / temp).t()
    k, b = q.shape
    q = q / q.sum()
    for _ in range(iterations):
        q = q / q.sum(dim=1, keepdim=True) / k
        q = q / q.sum(dim=0, keepdim=True) / b
    return (q * b).t()


def _koleo64(x: torch.Tensor) -> torch.Tensor:
    x = F.normalize(x.double(), dim=-1, eps=1e-8)
    d = torch.cdist(x, x) + torch.diag(torch.full((x.shape[0],), float("inf"), dtype=x.dtype))
    return -torch.log(d.min(dim=1).values + 1e-8).mean()


def _reference_total(model: Distill, crops, masks: np.ndarray, temp: float = 0.07) -> float:
    """DINOv3's ``compute_losses`` for a distilled student, from scratch: the DINO term as its weighted global
    (diagonal ignored) and local parts, KoLeo per global view, iBOT at the masked patches of the UNMASKED
    student's global crops (per-image mean, over all global crops)."""
    n_g, b = 2, crops[0].shape[0]
    n_l = len(crops) - n_g
    with torch.no_grad():
        t_cls, t_pat = model.teacher.backbone.forward_cls_patches(torch.cat(crops[:n_g]))
        t_probs = _sinkhorn64(model.teacher.head(t_cls), temp).reshape(n_g, b, -1)
        s_g = [model.student.backbone.forward_cls_patches(c) for c in crops[:n_g]]  # one crop at a time
        s_cls = torch.stack([cls for cls, _ in s_g])
        s_pat = torch.cat([pat for _, pat in s_g])
        s_loc = torch.stack([model.student.backbone(c) for c in crops[n_g:]])
        logp_g = F.log_softmax(model.student.head(s_cls).double() / 0.1, dim=-1)
        logp_l = F.log_softmax(model.student.head(s_loc).double() / 0.1, dim=-1)
        pair = -torch.einsum("sbk,tbk->st", logp_g, t_probs)
        global_loss = (pair.sum() - pair.diagonal().sum()) / (b * n_g * n_g - b * n_g)
        local_loss = -torch.einsum("sbk,tbk->", logp_l, t_probs) / (b * n_l * n_g)
        g_terms, l_terms = n_g * (n_g - 1), n_g * n_l
        dino = (g_terms * global_loss + l_terms * local_loss) / (g_terms + l_terms)
        koleo = sum(_koleo64(s_cls[i]) for i in range(n_g)) / n_g
        flat = torch.from_numpy(masks)
        t_patch = _sinkhorn64(model.teacher.patch_head(t_pat[flat]), temp)
        s_patch = F.log_softmax(model.student.patch_head(s_pat[flat]).double() / 0.1, dim=-1)
        weights = (1.0 / flat.sum(1).clamp(min=1).double()).unsqueeze(1).expand_as(flat)[flat]
        ibot = -(torch.sum(t_patch * s_patch, dim=-1) * weights).sum() / flat.shape[0]
    return float(dino + 0.1 * n_g * koleo + 1.0 * ibot)


def test_dinov3_loss_equals_dinov3s_formulas_with_an_unmasked_student(teacher_path):
    torch.manual_seed(0)
    model = Distill(teacher=teacher_path, objective="dinov3", **STUDENT).eval()  # eval: BN running stats
    # DINOv3 never masks a distilled student: it has no mask token to read.
    assert getattr(model.student.backbone, "mask_token", None) is None
    g = torch.Generator().manual_seed(1)
    crops = [torch.randn(4, 3, 32, 32, generator=g) for _ in range(2)]
    crops += [torch.randn(4, 3, 16, 16, generator=g) for _ in range(3)]
    masks = np.zeros((8, 16), dtype=bool)
    masks[0, [0, 1, 4, 5]] = True
    masks[3, 2:10] = True
    masks[6, [15]] = True  # rows 1, 2, 4, 5, 7 unmasked: they count in the mean and add nothing
    with torch.no_grad():
        out = model.compute_losses(crops, MaskedPatches.from_host(masks), epoch=0, update_center=False)
    want = _reference_total(model, crops, masks)
    assert float(out.total) == pytest.approx(want, rel=1e-5)
    # The same model with the student's global crops masked (the dino objective's way) gives another loss.
    model.student.backbone.enable_masking()
    with torch.no_grad():  # a learnt-looking mask token, which a masked student reads
        model.student.backbone.mask_token.normal_(generator=torch.Generator().manual_seed(3))
    model.hparams.objective = "dino"
    with torch.no_grad():
        masked = model.compute_losses(crops, MaskedPatches.from_host(masks), epoch=0, update_center=False)
    assert abs(float(masked.total) - want) > 0.01


def test_ema_update_averages_parameters_and_float_buffers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    ema = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model(torch.randn(8, 3))  # running statistics and the batch count move
    before, src = ({k: v.clone() for k, v in m.state_dict().items()} for m in (ema, model))
    ema_update_(ema, model, 0.9)
    for key, value in ema.state_dict().items():
        if value.is_floating_point():
            torch.testing.assert_close(value, 0.9 * before[key] + 0.1 * src[key], rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(value, src[key]), key  # num_batches_tracked: copied


class _Snapshots(L.Callback):
    def __init__(self) -> None:
        self.students: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.students.append({k: v.detach().clone() for k, v in pl_module.student.state_dict().items()})


def test_dinov3_fit_the_student_ema_is_what_everything_reads(tmp_path, tiny, teacher_path, monkeypatch):
    torch.manual_seed(0)
    model = Distill(teacher=teacher_path, objective="dinov3", momentum_teacher=0.9, **STUDENT)
    assert model.evaluated_network == "student_ema"
    ema = {
        k: v.detach().clone() for k, v in model.student.state_dict().items()
    }  # the EMA starts as the student
    assert getattr(model.student.backbone, "mask_token", None) is None  # an unmasked student has none
    snapshots = _Snapshots()
    trainer = tiny.trainer(tmp_path, max_epochs=1, limit_train_batches=3, callbacks=[snapshots])
    trainer.fit(model, tiny.loader(n=12))
    assert trainer.global_step == 3
    momenta = model.schedules.momentum[:3]
    assert momenta[0] == pytest.approx(0.9) and momenta[2] > momenta[1] > momenta[0]  # cosine towards 1
    for m, student in zip(momenta, snapshots.students, strict=True):  # ema <- m ema + (1 - m) student
        ema = {
            k: m * v + (1 - m) * student[k] if v.is_floating_point() else student[k] for k, v in ema.items()
        }
    for key, value in model.student_ema.state_dict().items():
        torch.testing.assert_close(value, ema[key], rtol=1e-5, atol=1e-6, msg=key)
    assert not torch.equal(model.student_ema.backbone.cls_token, model.student.backbone.cls_token)

    want = model.student_ema.backbone.state_dict()
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    for backbone in (teacher_backbone(ckpt)[0], build_backbone(ckpt)):  # export; knn/linear/embed/visualize
        assert all(torch.equal(v, want[k]) for k, v in backbone.state_dict().items())
    assert torch.equal(model(torch.ones(1, 3, 16, 16)), model.student_ema.backbone(torch.ones(1, 3, 16, 16)))

    seen = []

    def features(self, backbone, dataset, device, trainer):  # the embedding pass, recorded
        seen.append(backbone)
        return torch.eye(2), torch.tensor([0, 1])

    monkeypatch.setattr(OnlineKNN, "_features", features)
    knn = OnlineKNN(k=1)
    knn._datasets = ([0, 1], [0, 1])  # resolved, as during a fit with labelled data
    assert knn.evaluate(trainer, model) == 100.0
    assert seen == [model.student_ema.backbone] * 2


def test_dinov3_learns_a_fixed_batch(teacher_path):
    """8 AdamW steps on one multi-crop batch lower the loss against the frozen teacher by a quarter (with DINO's
    weight-normalised head, whose unit-norm prototypes start far from the uniform output; DINOv3's plain layer
    starts at trunc-normal 0.02, near the uniform output's loss)."""
    torch.manual_seed(0)
    model = Distill(teacher=teacher_path, objective="dinov3", head_last_layer="weight_norm", **STUDENT)
    g = torch.Generator().manual_seed(2)
    crops = [torch.randn(4, 3, 16, 16, generator=g) for _ in range(2)]
    crops += [torch.randn(4, 3, 8, 8, generator=g) for _ in range(2)]
    masks = MaskedPatches.from_host(np.random.default_rng(0).random((8, 4)) < 0.4)
    opt = torch.optim.AdamW([p for p in model.student.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(8):
        out = model.compute_losses(crops, masks, 0, update_center=True)
        opt.zero_grad()
        out.total.backward()
        opt.step()
        losses.append(float(out.total.detach()))
    assert losses[-1] < 0.75 * losses[0], losses


@pytest.mark.slow
def test_dinov3_resumes_exactly_with_its_student_ema(tmp_path, tiny, teacher_path):
    """A run stopped after its epoch-1 checkpoint and resumed ends with the uninterrupted run's student and EMA."""

    class StopAfterFirstEpoch(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            trainer.should_stop = True

    def fit(folder, ckpt_path=None, stop=False):
        torch.manual_seed(0)
        model = Distill(teacher=teacher_path, objective="dinov3", momentum_teacher=0.9, **STUDENT)
        trainer = tiny.trainer(
            tmp_path / folder, max_epochs=2, callbacks=[StopAfterFirstEpoch()] if stop else []
        )
        trainer.fit(model, tiny.loader(n=8, shuffle=False), ckpt_path=ckpt_path)
        return model, trainer

    whole, _ = fit("whole")
    fit("first", stop=True)
    resumed, trainer = fit("resumed", ckpt_path=tmp_path / "first" / "ckpt" / "last.ckpt")
    assert trainer.global_step == 4
    for network in ("student", "student_ema"):
        want = getattr(whole, network).state_dict()
        for key, value in getattr(resumed, network).state_dict().items():
            assert torch.equal(value, want[key]), (network, key)
