"""Block masks for iBOT against DINOv2's specification: per-image fraction, share of masked images, blocks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ssl_xcit.dino.masking import BlockMaskGenerator, draw_masks


def _components(mask: np.ndarray) -> list[int]:
    """Sizes of the 4-connected components of a boolean grid."""
    seen = np.zeros_like(mask)
    sizes = []
    for start in zip(*np.nonzero(mask), strict=True):
        if seen[start]:
            continue
        stack, size = [start], 0
        seen[start] = True
        while stack:
            i, j = stack.pop()
            size += 1
            for di, dj in ((1, 0), (-1, 0), (0, 1), (0, -1)):
                a, b = i + di, j + dj
                if 0 <= a < mask.shape[0] and 0 <= b < mask.shape[1] and mask[a, b] and not seen[a, b]:
                    seen[a, b] = True
                    stack.append((a, b))
        sizes.append(size)
    return sizes


@pytest.mark.parametrize("grid", [(14, 14), (12, 12), (8, 8), (7, 10)])
def test_fractions_share_and_exact_counts(grid):
    rng = np.random.default_rng(0)
    n_patches = grid[0] * grid[1]
    fractions = []
    for _ in range(20):
        masks = draw_masks(64, grid, rng)
        counts = masks.sum(1)
        # Exactly half of the crops are masked (DINOv2's mask_probability 0.5); the others keep every patch.
        assert (counts > 0).sum() == 32 and (counts == 0).sum() == 32
        masked = np.sort(counts[counts > 0])
        # Stratified draws: the i-th smallest count lies in the i-th of 32 equal slices of [0.1, 0.5].
        edges = np.linspace(0.1, 0.5, 33)
        assert np.all(masked >= np.floor(n_patches * edges[:-1]) - 1e-9)
        assert np.all(masked <= np.floor(n_patches * edges[1:]) + 1e-9)
        fractions.extend((masked / n_patches).tolist())
    fractions = np.array(fractions)
    # Uniform on [0.1, 0.5] (minus the floor of int(N * f)): mean 0.3, standard deviation 0.4 / sqrt(12).
    assert abs(fractions.mean() - (0.3 - 0.5 / n_patches)) < 0.01
    assert abs(fractions.std() - 0.4 / math.sqrt(12)) < 0.01


def test_generator_hits_the_target_count_exactly():
    rng = np.random.default_rng(1)
    for grid in [(4, 4), (8, 8), (14, 14), (28, 28)]:
        generator = BlockMaskGenerator(grid)
        n = grid[0] * grid[1]
        for _ in range(200):
            target = int(n * rng.uniform(0.1, 0.5))
            assert generator(target, rng).sum() == target


def test_masked_regions_are_blocks_not_scattered_patches():
    rng = np.random.default_rng(2)
    generator = BlockMaskGenerator((14, 14))
    block_components, scattered_components = [], []
    for _ in range(200):
        target = int(196 * rng.uniform(0.1, 0.5))
        mask = generator(target, rng)
        sizes = _components(mask)
        # Components are unions of blocks of >= 3 patches (an area >= 4 rounds to >= 3 patches); only the
        # last top-up blocks, drawn when fewer than 4 patches are missing, can be smaller (< 4 patches in all).
        small = [size for size in sizes if size < 3]
        assert sum(small) < 4, sizes
        block_components.append(len(sizes))
        scattered = np.zeros(196, dtype=bool)
        scattered[rng.permutation(196)[:target]] = True
        scattered_components.append(len(_components(scattered.reshape(14, 14))))
    # The same counts scattered at random fall apart into many more pieces.
    assert np.mean(block_components) * 3 < np.mean(scattered_components)


def test_block_aspect_ratios_are_log_uniform_in_range():
    rng = np.random.default_rng(3)
    generator = BlockMaskGenerator((64, 64))
    log_ratios = []
    for _ in range(2000):
        mask = np.zeros((64, 64), dtype=bool)
        added = generator._add_block(mask, 200, rng)
        rows, cols = np.nonzero(mask)
        h, w = rows.max() - rows.min() + 1, cols.max() - cols.min() + 1
        assert added == h * w  # one rectangle
        log_ratios.append(math.log(h / w))
    log_ratios = np.array(log_ratios)
    bound = math.log(1 / 0.3)
    # Rounding the sides to whole patches widens the range slightly; the shape stays symmetric and spread.
    assert log_ratios.min() >= -bound - 0.5 and log_ratios.max() <= bound + 0.5
    assert abs(log_ratios.mean()) < 0.05
    assert abs(log_ratios.std() - 2 * bound / math.sqrt(12)) < 0.1


def test_bad_settings_name_the_value():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"0 <= low <= high <= 1, got \(0.6, 0.2\)"):
        draw_masks(4, (4, 4), rng, ratio_range=(0.6, 0.2))
    with pytest.raises(ValueError, match="mask_probability must be in"):
        draw_masks(4, (4, 4), rng, mask_probability=1.5)
