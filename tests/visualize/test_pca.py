from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from ssl_xcit.models import create_model
from ssl_xcit.visualize.common import VisualizeError
from ssl_xcit.visualize.pca import pca_colours, pca_figure


def test_two_token_clusters_split_into_object_and_background():
    # 4x4 grid: the border patches are one cluster (background), the 2x2 centre another (object).
    torch.manual_seed(0)
    grid = np.zeros((4, 4), bool)
    grid[1:3, 1:3] = True
    tokens = torch.randn(16, 8) * 0.01
    tokens[torch.from_numpy(grid.ravel())] += torch.tensor([5.0] + [0.0] * 7)
    out = pca_colours([tokens], [(4, 4)], threshold=0.5)
    assert (out.foreground[0] == grid).all()
    assert (out.rgb[0][~grid] == 0).all()  # background black
    assert out.rgb[0][grid].max() > 0.5
    # The sign is oriented by the border: negating the tokens must give the same split.
    flipped = pca_colours([-tokens], [(4, 4)], threshold=0.5)
    assert (flipped.foreground[0] == grid).all()


def test_joint_fit_gives_one_colour_scale_for_several_images():
    torch.manual_seed(0)
    a, b = torch.randn(9, 6), torch.randn(12, 6)
    out = pca_colours([a, b], [(3, 3), (3, 4)], threshold=None)
    stacked = np.concatenate([out.rgb[0].reshape(-1, 3), out.rgb[1].reshape(-1, 3)])
    # Min-max over both images together: each channel spans exactly [0, 1] jointly, not per image.
    assert np.allclose(stacked.min(0), 0) and np.allclose(stacked.max(0), 1)
    with pytest.raises(VisualizeError, match="threshold must be in"):
        pca_colours([a], [(3, 3)], threshold=1.5)


def test_object_and_background_differ_in_colour_on_a_constructed_image(tmp_path):
    picture = np.zeros((128, 128, 3), np.uint8)
    picture[32:96, 32:96] = (255, 255, 255)
    path = tmp_path / "square.png"
    Image.fromarray(picture).save(path)
    torch.manual_seed(0)
    fig, out = pca_figure(
        create_model("xcit_nano_12_p16"), [path], size=128, threshold=None, show_progress=False
    )
    rgb = out.rgb[0]
    assert rgb.shape == (8, 8, 3)
    inside = np.zeros((8, 8), bool)
    inside[3:5, 3:5] = True  # patches well inside the square (receptive fields stay within it)
    outside = np.zeros((8, 8), bool)
    outside[[0, 0, 7, 7], [0, 7, 0, 7]] = True
    gap = np.abs(rgb[inside].mean(0) - rgb[outside].mean(0)).max()
    assert gap > 0.25, gap
    fig.canvas.draw()
    assert np.asarray(fig.canvas.buffer_rgba())[..., :3].std() > 10
