"""iBOT's diagnosis options: BatchNorm statistics from unmasked crops, the patch weight's warm-up, and the
patch tokens retrieval describes images with (docs/ibot.md, "Diagnosis")."""

from __future__ import annotations

import copy

import lightning as L
import numpy as np
import pytest
import torch
from test_ibot import HEAD, Crops  # tests/dino is on sys.path: pytest prepends a test file's folder
from torch import nn
from torch.utils.data import DataLoader

from ssl_xcit.dino.masked_bn import statistics_from_unmasked, weighted_batch_norm
from ssl_xcit.dino.module import DINO
from ssl_xcit.dino.schedules import dino_schedules, linear_warmup
from ssl_xcit.errors import UserError
from ssl_xcit.models import create_model
from ssl_xcit.parallel.syncbn import convert_sync_batchnorm


def test_weighted_batch_norm_equals_batch_norm_on_the_kept_crops():
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(5).train()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    x = torch.randn(6, 5, 4, 3) * 3 + 1
    keep = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    reference = copy.deepcopy(bn)
    kept = x[keep.bool()]
    expected_kept = reference(kept)  # torch's BatchNorm on the kept crops alone
    var, mean = torch.var_mean(kept, dim=(0, 2, 3), unbiased=False)
    expected_all = (x - mean.view(1, -1, 1, 1)) / torch.sqrt(var.view(1, -1, 1, 1) + bn.eps)
    expected_all = expected_all * bn.weight.view(1, -1, 1, 1) + bn.bias.view(1, -1, 1, 1)
    out = weighted_batch_norm(bn, x, keep)
    torch.testing.assert_close(out[keep.bool()], expected_kept, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, expected_all, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bn.running_mean, reference.running_mean)
    torch.testing.assert_close(bn.running_var, reference.running_var)
    assert int(bn.num_batches_tracked) == 1
    # No kept crop: every crop counts, as plain BatchNorm.
    plain = copy.deepcopy(reference)
    torch.testing.assert_close(
        weighted_batch_norm(reference, x, torch.zeros(6)), plain(x), rtol=1e-5, atol=1e-5
    )


def test_xcit_stem_statistics_come_from_the_unmasked_crops():
    torch.manual_seed(0)
    model = create_model("xcit_nano_12_p8", depth=1).train()
    model.enable_masking()
    x = torch.randn(4, 3, 32, 32)
    mask = torch.zeros(4, 16, dtype=torch.bool)
    mask[1, :6] = True
    mask[3, 5:9] = True
    reference = copy.deepcopy(model)
    first_bn = model.patch_embed.proj[0][1]
    with statistics_from_unmasked(model, mask):
        model.forward_cls_patches(x, mask)
    reference.patch_embed.proj[0](x[[0, 2]])  # the first stem conv + BN on the unmasked crops alone
    torch.testing.assert_close(first_bn.running_mean, reference.patch_embed.proj[0][1].running_mean)
    torch.testing.assert_close(first_bn.running_var, reference.patch_embed.proj[0][1].running_var)
    assert "forward" not in vars(first_bn)  # the BatchNorm layers are themselves again after the block
    # Without masked crops the option changes nothing.
    plain, patched = copy.deepcopy(reference), copy.deepcopy(reference)
    none = torch.zeros(4, 16, dtype=torch.bool)
    with statistics_from_unmasked(patched, none):
        out = patched.forward_cls_patches(x, none)
    expected = plain.forward_cls_patches(x, none)
    torch.testing.assert_close(out[0], expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1], expected[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("convert", [nn.SyncBatchNorm.convert_sync_batchnorm, convert_sync_batchnorm])
def test_unmasked_statistics_refuse_sync_batchnorm(convert):
    model = convert(create_model("xcit_nano_12_p8", depth=1))
    with pytest.raises(UserError, match="ibot_bn_stats: unmasked works on one process"):
        with statistics_from_unmasked(model, torch.zeros(2, 16, dtype=torch.bool)):
            pass


def test_linear_warmup_of_the_patch_weight():
    np.testing.assert_allclose(linear_warmup(2.0, 0.5, 2, 4), [0, 1, 2, 2, 2, 2, 2, 2])
    np.testing.assert_allclose(linear_warmup(1.0, 0, 1, 3), [1, 1, 1])
    hp = {"accumulate_grad_batches": 1, "warmup_epochs": 0, "scale_lr_with_batch": False, "lr": 0.1,
          "min_lr": 0.0, "weight_decay": 0.04, "weight_decay_end": 0.4, "momentum_teacher": 0.99,
          "ibot_loss_weight": 1.0, "ibot_weight_warmup_epochs": 1}  # fmt: skip
    s = dino_schedules(hp, epochs=2, batches=4, per_device_batch=8, world_size=1)
    assert [s.ibot_weight_at(i) for i in (0, 2, 4, 100)] == [0.0, 0.5, 1.0, 1.0]


# ~10 s a fit (the suite's time budget): the warm-up's schedule and the unmasked statistics have fast tests of
# their own (test_linear_warmup_of_the_patch_weight, tests/dino/test_lockstep_crops.py)
@pytest.mark.slow
@pytest.mark.parametrize("options", [{"ibot_weight_warmup_epochs": 1.0}, {"ibot_bn_stats": "unmasked"}])
def test_dino_trains_with_each_diagnosis_option(options, tmp_path):
    def fit(**extra) -> DINO:
        L.seed_everything(0)
        model = DINO("xcit_nano_12_p8", backbone_kwargs={"depth": 1}, ibot_loss_weight=1.0, warmup_epochs=0,
                     freeze_last_layer=0, lr=0.05, **HEAD, **extra)  # fmt: skip
        trainer = L.Trainer(max_epochs=1, limit_train_batches=2, accelerator="cpu", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path)  # fmt: skip
        trainer.fit(model, DataLoader(Crops(), batch_size=4))
        assert trainer.global_step == 2
        return model

    plain, changed = fit(), fit(**options)
    if "ibot_weight_warmup_epochs" in options:  # 2 steps per epoch: weight 0 then 0.5
        assert changed.ibot_weight_now == 0.5 and plain.ibot_weight_now == 1.0
    stem = "student.backbone.patch_embed.proj.0.1.running_mean"
    differs = not torch.equal(plain.state_dict()[stem], changed.state_dict()[stem])
    assert differs  # both options change what the student learns or normalises with


def test_bad_diagnosis_options_are_named():
    with pytest.raises(UserError, match="ibot_bn_stats must be 'all' or 'unmasked', got 'some'"):
        DINO(
            "xcit_nano_12_p8",
            backbone_kwargs={"depth": 1},
            ibot_loss_weight=1.0,
            ibot_bn_stats="some",
            **HEAD,
        )
    with pytest.raises(UserError, match="ibot_weight_warmup_epochs must be >= 0, got -1"):
        DINO("xcit_nano_12_p8", backbone_kwargs={"depth": 1}, ibot_loss_weight=1.0, ibot_weight_warmup_epochs=-1,
             **HEAD)  # fmt: skip
