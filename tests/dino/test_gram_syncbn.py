"""Gram anchoring under DDP: the Gram teacher's BatchNorms (XCiT's stem and LPI, batch statistics in its
forward) are synchronised like the EMA teacher's, so a 2-process run equals one process on the same global
batch (found by the invariant matrix: the Gram rows with XCiT differed by ~7e-3 of their movement)."""

from __future__ import annotations

from types import SimpleNamespace

from torch.nn.modules.batchnorm import _BatchNorm

from ssl_xcit.dino.module import DINO
from ssl_xcit.parallel.syncbn import AllReduceBatchNorm


def test_configure_model_synchronises_the_gram_teachers_batchnorms_under_ddp():
    model = DINO("xcit_nano_12_p8", backbone_kwargs={"depth": 1}, out_dim=16, head_hidden_dim=16,
                 head_bottleneck_dim=8, gram_loss_weight=1.0, gram_start_step=1)  # fmt: skip
    model._trainer = SimpleNamespace(world_size=2)
    model.configure_model()
    norms = [m for m in model.gram_teacher.backbone.modules() if isinstance(m, _BatchNorm)]
    assert norms and all(isinstance(m, AllReduceBatchNorm) for m in norms)
    assert all(m.momentum == 0.0 for m in norms)  # its running statistics stay those it was taken with
    teacher_norms = [m for m in model.teacher.modules() if isinstance(m, _BatchNorm)]
    assert all(isinstance(m, AllReduceBatchNorm) for m in teacher_norms)
    assert model.state_dict().keys() == DINO(**model.hparams).state_dict().keys()  # checkpoints unchanged
