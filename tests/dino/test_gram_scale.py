"""The Gram teacher's crops at a fractional scale (``gram_resolution_scale: 1.5``, DINOv3's high-resolution stage:
768 px Gram crops for 512 px global crops, 1152 for 768): the step takes crops of 1.5 x the global side and
computes the term on them; other sides are a one-line error naming the shape wanted."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from ssl_xcit.data.crops import gram_crop_side
from ssl_xcit.errors import UserError


def test_dinov3s_sides_and_rounding():
    assert [gram_crop_side(s, 1.5) for s in (512, 768, 32, 15)] == [768, 1152, 48, 23]  # 22.5: halves up
    assert [gram_crop_side(32, s) for s in (1, 2, 1.25)] == [32, 64, 40]


def test_the_step_takes_gram_crops_at_1_5x_and_refuses_others():
    torch.manual_seed(0)
    model = tiny_model(
        backbone="vit_tiny_patch16_224", drop_path_rate=0.0, gram_loss_weight=1.0, gram_resolution_scale=1.5
    )
    assert model.gram_crops_scale == 1.5
    crops = [torch.randn(2, 3, s, s) for s in (32, 32, 16, 16)]
    model._update_gram_teacher(0)
    with torch.no_grad():
        for p in model.student.backbone.parameters():
            p.add_(0.05 * torch.randn_like(p))
    gram_crops = [torch.randn(2, 3, 48, 48) for _ in range(2)]
    out = model.compute_losses(crops, None, 0, update_center=False, gram_crops=gram_crops)
    assert out.gram is not None and float(out.gram) > 0
    with pytest.raises(
        UserError, match=r"of shape \(2, 3, 48, 48\) \(gram_resolution_scale 1.5 x .* got \[\(2, 3, 64, 64\)"
    ):
        model.compute_losses(crops, None, 0, update_center=False, gram_crops=[torch.randn(2, 3, 64, 64)] * 2)
