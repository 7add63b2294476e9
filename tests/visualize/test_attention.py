from __future__ import annotations

import numpy as np
import pytest
import torch

from ssl_xcit.models import create_model
from ssl_xcit.visualize import attention_heatmaps, overlay


@pytest.fixture(scope="module")
def model():
    return create_model("xcit_nano_12_p16").train()


def test_heatmaps_are_distributions_at_image_resolution(model):
    maps = attention_heatmaps(model, torch.randn(2, 3, 48, 64))
    assert maps.shape == (2, 4, 48, 64)
    assert torch.allclose(maps.sum((-2, -1)), torch.ones(2, 4), atol=1e-5)
    assert model.training  # the caller's mode is restored


def test_heatmap_values_come_from_the_class_attention(model):
    x = torch.randn(1, 3, 32, 48)
    maps = attention_heatmaps(model, x)
    model.eval()
    with torch.no_grad():
        raw, grid = model.get_class_attention(x)
    model.train()
    patches = raw[-1][0, :, 1:] / raw[-1][0, :, 1:].sum(-1, keepdim=True)
    # Every pixel of patch (i, j) carries that patch's share divided by the patch area.
    assert torch.allclose(maps[0, :, ::16, ::16].reshape(4, -1) * 256, patches, atol=1e-6)


def test_threshold_masks_keep_the_requested_mass(model):
    x = torch.randn(1, 3, 64, 64)
    mask = attention_heatmaps(model, x, threshold=0.6)
    dense = attention_heatmaps(model, x)
    assert set(mask.unique().tolist()) <= {0.0, 1.0}
    kept = (dense * mask).sum((-2, -1))
    assert (kept >= 0.6 - 1e-5).all()
    with pytest.raises(ValueError, match="threshold must be in"):
        attention_heatmaps(model, x, threshold=1.5)


def test_overlay_blends_exactly():
    image = np.full((2, 2, 3), 100, np.uint8)
    heat = np.array([[0.0, 1.0], [0.5, 0.0]])
    out = overlay(image, heat, alpha=0.0)
    assert (out == 100).all()
    full = overlay(image, heat, alpha=1.0, cmap="gray")
    assert full[0, 1].tolist() == [255, 255, 255] and full[0, 0].tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="differ in size"):
        overlay(image, np.zeros((3, 3)))


def test_mass_mask_keeps_the_smallest_set_holding_the_fraction():
    from ssl_xcit.visualize.attention import mass_mask

    heat = torch.tensor([[0.5, 0.1], [0.3, 0.1]])
    assert mass_mask(heat, 0.6).tolist() == [
        [True, False],
        [True, False],
    ]  # 0.5 alone < 0.6, + 0.3 crosses it
    assert mass_mask(heat, 0.5).tolist() == [[True, False], [False, False]]
    assert mass_mask(heat, 1.0).all()


def test_unsupported_backbone_is_named():
    from ssl_xcit.models.base import Backbone
    from ssl_xcit.visualize.common import VisualizeError

    class Pooled(Backbone):
        family, name = "toy", "toy_pooled"

    with pytest.raises(VisualizeError, match=r"backbone toy_pooled \(toy\) has no attention maps"):
        attention_heatmaps(Pooled(), torch.randn(1, 3, 32, 32))


def test_any_resolution_768_px_non_square(model):
    maps = attention_heatmaps(model, torch.randn(1, 3, 512, 768))
    assert maps.shape == (1, 4, 512, 768)
    assert torch.allclose(maps.sum((-2, -1)), torch.ones(1, 4), atol=1e-4)
