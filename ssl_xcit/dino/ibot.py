"""iBOT's masked patch term inside DINO's step: the masks, the patch forward of student and teacher.

The masks are drawn on the host (numpy, ``ssl_xcit.dino.masking``), so everything that depends on which
patches are masked, the masked positions, their count and the per-patch weights of the loss, is a host fact.
It is computed there and queued to the device with a non-blocking copy (:class:`MaskedPatches`); the device
only gathers rows at known positions. Nothing in the term reads a value back from the device or makes a
tensor of data-dependent shape (``masks.sum()`` read on the host or ``tokens[masks]`` would each stop the
host until the GPU queue has drained, every step). The loss itself is :mod:`ssl_xcit.dino.ibot_loss`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from ssl_xcit.dino.masking import BlockMaskGenerator, check_mask_settings, draw_masks
from ssl_xcit.dino.multicrop import MultiCropWrapper
from ssl_xcit.utils.transfer import host_to_device


class MaskedPatches(NamedTuple):
    """One batch's masks and what the term needs from them, all computed on the host.

    ``masks`` (n_images, N) bool is what the student's backbone replaces by its mask token; ``image`` and
    ``patch`` (M,) int64 locate the M masked patches in ``masks[masks]`` order (row-major); ``weights`` (M,)
    float32 is 1 / (masked patches of the patch's image), the per-image mean of DINOv2's loss."""

    masks: torch.Tensor
    image: torch.Tensor
    patch: torch.Tensor
    weights: torch.Tensor
    n_images: int
    count: int

    @classmethod
    def from_host(cls, masks: np.ndarray, device: torch.device | str = "cpu") -> MaskedPatches:
        """Index, count and weights of host ``masks`` (n_images, N) bool, queued to ``device``."""
        masks = np.ascontiguousarray(masks, dtype=bool)
        if masks.ndim != 2:
            raise ValueError(f"masks must be (n_images, patches), got shape {masks.shape}")
        device = torch.device(device)
        image, patch = np.nonzero(masks)  # row-major: the order of masks[masks]
        per_image = np.maximum(masks.sum(axis=1), 1).astype(np.float32)
        weights = (np.float32(1.0) / per_image)[image]
        return cls(
            masks=host_to_device(masks, device),
            image=host_to_device(image.astype(np.int64), device),
            patch=host_to_device(patch.astype(np.int64), device),
            weights=host_to_device(weights, device),
            n_images=int(masks.shape[0]),
            count=int(image.size),
        )

    def select(self, tokens: torch.Tensor) -> torch.Tensor:
        """The rows (M, C) of ``tokens`` (n_images, N, C) at the masked patches: a gather at known positions,
        with an output shape known on the host."""
        return tokens[self.image, self.patch]


class MaskSampler:
    """DINOv2's block masks for the student's global crops, one block generator per token grid.

    Args:
        ratio_range: masked fraction of a masked crop, uniform in this range.
        probability: share of the global crops that are masked.
    """

    def __init__(self, ratio_range: tuple[float, float], probability: float) -> None:
        self.ratio_range = (float(ratio_range[0]), float(ratio_range[1]))
        self.probability = float(probability)
        check_mask_settings(self.ratio_range, self.probability)  # at construction, not at the first step
        self._generators: dict[tuple[int, int], BlockMaskGenerator] = {}

    def __call__(self, grid: tuple[int, int], n_images: int, seed: Sequence[int]) -> np.ndarray:
        """Masks (n_images, h*w) from a generator seeded by ``seed`` (run seed, rank, step, batch): a resumed
        run draws the same masks, and ranks differ."""
        generator = self._generators.get(grid)
        if generator is None:
            generator = self._generators[grid] = BlockMaskGenerator(grid)
        rng = np.random.default_rng(list(seed))
        return draw_masks(n_images, grid, rng, self.ratio_range, self.probability, generator)


class MaskedForward(NamedTuple):
    teacher_output: torch.Tensor  # (G*B, K) head outputs of the unmasked global crops
    student_output: torch.Tensor  # (V*B, K) head outputs of all crops, the global ones masked
    student_embedding: torch.Tensor  # (V*B, C) backbone embeddings of the student's crops
    student_patch_logits: torch.Tensor  # (M, K') at the masked patches
    teacher_patch_logits: torch.Tensor  # (M, K') at the same patches of the unmasked crops
    student_patch_tokens: torch.Tensor  # (G*B, N, C) final-norm patch tokens of the masked pass (Gram)


def masked_forward(
    student: MultiCropWrapper,
    teacher: MultiCropWrapper,
    crops: Sequence[torch.Tensor],
    patches: MaskedPatches,
    n_global: int = 2,
    bn_from_unmasked: bool = False,
) -> MaskedForward:
    """Teacher (no grad, unmasked) and student (masked global crops) forwards with their patch heads at the
    masked positions."""
    with torch.no_grad():
        teacher_output, _, teacher_tokens = teacher.forward_with_patches(crops[:n_global], n_global=n_global)
        teacher_patch_logits = teacher.patch_logits(patches.select(teacher_tokens))
    student_output, student_embedding, student_tokens = student.forward_with_patches(
        crops, patches.masks, n_global=n_global, bn_from_unmasked=bn_from_unmasked
    )
    student_patch_logits = student.patch_logits(patches.select(student_tokens))
    return MaskedForward(
        teacher_output,
        student_output,
        student_embedding,
        student_patch_logits,
        teacher_patch_logits,
        student_tokens,
    )
