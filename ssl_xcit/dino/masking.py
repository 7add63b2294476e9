"""Block-wise masks for iBOT's masked patch distillation, with DINOv2's statistics.

Per batch of global crops (DINOv2, ``collate_data_and_cast``):

- a share ``mask_probability`` (0.5) of the images is masked, the rest keeps every patch;
- each masked image gets a masked fraction drawn uniformly from ``ratio_range`` ([0.1, 0.5]). The draws are
  stratified, as in DINOv2: the range is cut into one interval per masked image and each image draws from its
  own interval, so a batch always spans the whole range;
- the masked patches form blocks (BEiT's generator): rectangles of random area, at least ``min_block_patches``
  patches, with a log-uniform aspect ratio in [0.3, 1/0.3], added until the image's target count is reached.
  A block that would overshoot the target is redrawn, so every masked image has exactly its target count
  unless the grid cannot hold it in blocks (not seen for grids of 4x4 and up; ``tests/dino/test_masking.py``).

Masks are drawn on the CPU in the training process, from a generator seeded per step: a resumed run draws the
same masks, and nothing depends on the DataLoader. ``benchmarks/bench_masking.py`` measures the cost
(docs/ibot.md: a few milliseconds per batch of 128 masks, against a step of tens to hundreds).
"""

from __future__ import annotations

import math

import numpy as np

from ssl_xcit.errors import UserError


class BlockMaskGenerator:
    """Masks of exactly ``n`` patches on an ``(h, w)`` grid, built from rectangular blocks.

    Args:
        grid: token grid ``(h, w)`` of the backbone for the masked crops.
        min_block_patches: smallest block area (BEiT and DINOv2: 4).
        aspect_range: aspect ratios of a block are log-uniform in this range (BEiT and DINOv2: 0.3 .. 1/0.3).
        max_attempts: block draws per added block before giving up on that block.
    """

    def __init__(
        self,
        grid: tuple[int, int],
        min_block_patches: int = 4,
        aspect_range: tuple[float, float] = (0.3, 1 / 0.3),
        max_attempts: int = 10,
    ) -> None:
        h, w = int(grid[0]), int(grid[1])
        if h < 1 or w < 1:
            raise ValueError(f"mask grid must be at least 1x1, got {grid}")
        if not 0 < aspect_range[0] <= aspect_range[1]:
            raise ValueError(f"aspect_range must be (low, high) with 0 < low <= high, got {aspect_range}")
        self.height, self.width = h, w
        self.min_block_patches = max(1, int(min_block_patches))
        self.log_aspect = (math.log(aspect_range[0]), math.log(aspect_range[1]))
        self.max_attempts = max_attempts

    @property
    def num_patches(self) -> int:
        return self.height * self.width

    def _add_block(self, mask: np.ndarray, budget: int, rng: np.random.Generator) -> int:
        """Mask one more block of at most ``budget`` new patches; returns how many were newly masked."""
        for _ in range(self.max_attempts):
            low = min(self.min_block_patches, budget)
            area = rng.uniform(low, budget)
            aspect = math.exp(rng.uniform(*self.log_aspect))
            h = int(round(math.sqrt(area * aspect)))
            w = int(round(math.sqrt(area / aspect)))
            if not (1 <= h <= self.height and 1 <= w <= self.width):
                continue
            top = int(rng.integers(0, self.height - h + 1))
            left = int(rng.integers(0, self.width - w + 1))
            window = mask[top : top + h, left : left + w]
            new = h * w - int(window.sum())
            if 0 < new <= budget:
                window[...] = True
                return new
        return 0

    def __call__(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """A boolean ``(h, w)`` mask with ``n`` masked patches (fewer only if blocks cannot reach ``n``)."""
        if not 0 <= n <= self.num_patches:
            raise ValueError(f"cannot mask {n} patches of a {self.height}x{self.width} grid")
        mask = np.zeros((self.height, self.width), dtype=bool)
        count = 0
        while count < n:
            added = self._add_block(mask, n - count, rng)
            if added == 0:
                break
            count += added
        return mask


def check_mask_settings(ratio_range: tuple[float, float], mask_probability: float) -> None:
    """A UserError naming the value when the masked-fraction range or the masked share is out of bounds."""
    low, high = ratio_range
    if not 0 <= low <= high <= 1:
        raise UserError(f"mask ratio range must satisfy 0 <= low <= high <= 1, got {ratio_range}")
    if not 0 <= mask_probability <= 1:
        raise UserError(f"mask_probability must be in [0, 1], got {mask_probability}")


def draw_masks(
    n_images: int,
    grid: tuple[int, int],
    rng: np.random.Generator,
    ratio_range: tuple[float, float] = (0.1, 0.5),
    mask_probability: float = 0.5,
    generator: BlockMaskGenerator | None = None,
) -> np.ndarray:
    """Masks ``(n_images, h * w)`` (bool, True = masked) for a batch of crops, DINOv2's way (module docstring).

    ``int(n_images * mask_probability)`` images are masked, at stratified uniform fractions of
    ``ratio_range``; which images they are is a random permutation. A numpy array: everything the step needs
    from the masks (indices, counts, weights) is computed from it on the host, never read back from a device.
    """
    check_mask_settings(ratio_range, mask_probability)
    low, high = ratio_range
    generator = generator or BlockMaskGenerator(grid)
    n_patches = generator.num_patches
    n_masked_images = int(n_images * mask_probability)
    edges = np.linspace(low, high, n_masked_images + 1)
    masks = np.zeros((n_images, n_patches), dtype=bool)
    for i in range(n_masked_images):
        fraction = rng.uniform(edges[i], edges[i + 1])
        masks[i] = generator(int(n_patches * fraction), rng).reshape(-1)
    return masks[rng.permutation(n_images)]
