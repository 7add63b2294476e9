"""The crop objects of a training stage, and DINOv3's high-resolution adaptation: larger crops for the last epochs.

DINOv3 ends its training with a short stage at higher resolution (``dinov3_vit7b16_high_res_adapt.yaml``: 30k
iterations after the main run, global crops of 512 or 768 px instead of 256, local crops of 112 to 336 px instead
of 112, the Gram teacher on 1.5x larger crops): dense features then hold up at the sizes they are used at. Here
the stage is the last ``high_res_epochs`` epochs of the fit; the datamodule builds the stage's loader when its
epoch starts (``reload_dataloaders_every_n_epochs``). The stage is a function of the epoch alone, so every rank is
in the same stage, and a run resumed mid-stage rebuilds the stage's crops.

The stage crops at one (global, local) size pair, or at a mix of pairs as DINOv3's (``crops.global_crops_size``,
``local_crops_size`` and ``global_local_crop_pairs_ratios``): every batch has one pair, drawn with the given
ratios (:class:`CropMix`). DINOv3 draws the pair of each batch from one generator seeded once per launch (its
``CombinedDataLoader``), so a restarted run starts the sequence over; here the pairs of an epoch are a function
of (run seed, epoch) and the batch's index in the epoch, the same on every rank, and a run resumed mid-epoch
continues the sequence (the sampler's position is in the checkpoint, ``ssl_xcit.data.resumable``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from ssl_xcit.data.crops import MultiCropGeometry
from ssl_xcit.data.device_crops import CropReader
from ssl_xcit.data.image_dataset import ImageDataset
from ssl_xcit.data.transforms import MultiCropTransform
from ssl_xcit.errors import UserError

# Keeps the pair draws a stream of their own: no other generator seeded from the run seed and the epoch repeats it.
_MIX_STREAM = 0x6D6978


@dataclass(frozen=True)
class StageCrops:
    """One stage's crops: DINO's PIL multi-crop (``augment_on: cpu``) and the geometry and worker reader of the
    device path (``augment_on: device``). Both are built in every mode: each validates what it must honour."""

    cpu: MultiCropTransform
    geometry: MultiCropGeometry
    reader: CropReader


def stage_crops(hp: Mapping[str, Any], global_crops_size: int, local_crops_size: int) -> StageCrops:
    """The crops of DINODataModule hyperparameters ``hp`` at the given crop sizes."""
    cpu = MultiCropTransform(
        global_crops_size=global_crops_size,
        global_crops_scale=hp["global_crops_scale"],
        local_crops_number=hp["local_crops_number"],
        local_crops_size=local_crops_size,
        local_crops_scale=hp["local_crops_scale"],
        global_blur_probs=hp["global_blur_probs"],
        local_blur_prob=hp["local_blur_prob"],
        global_solarize_probs=hp["global_solarize_probs"],
        local_solarize_prob=hp["local_solarize_prob"],
        color_jitter=hp["color_jitter"],
        color_jitter_prob=hp["color_jitter_prob"],
        grayscale_prob=hp["grayscale_prob"],
        blur_radius=hp["blur_radius"],
    )
    geometry = MultiCropGeometry(
        global_crops_size=global_crops_size,
        global_crops_scale=hp["global_crops_scale"],
        local_crops_number=hp["local_crops_number"],
        local_crops_size=local_crops_size,
        local_crops_scale=hp["local_crops_scale"],
    )
    return StageCrops(cpu, geometry, CropReader(geometry, hp["decode_on"]))


@dataclass(frozen=True)
class CropMix:
    """The (global, local) crop sides of the high-resolution stage and the share of batches of each pair."""

    sizes: tuple[tuple[int, int], ...]
    ratios: tuple[float, ...]  # summing to 1

    def pairs(self, seed: int, epoch: int, num_batches: int) -> np.ndarray:
        """Index into :attr:`sizes` of each of ``num_batches`` batches of ``epoch``: a function of (``seed``,
        ``epoch``) and the batch's index, nothing else (inverse CDF of the ratios on uniform draws)."""
        if len(self.sizes) == 1:
            return np.zeros(num_batches, dtype=np.int64)
        cdf = np.cumsum(self.ratios)
        cdf /= cdf[-1]
        uniform = np.random.default_rng([_MIX_STREAM, seed % 2**63, epoch]).random(num_batches)
        return np.searchsorted(cdf, uniform, side="right").astype(np.int64)


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_pair(value: Any) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) == 2
        and all(map(_is_size, value))
    )


def check_high_res(epochs: int, crops_size: Any, ratios: Sequence[float] | None = None) -> CropMix | None:
    """The high-resolution stage's crops (None when off); a one-line UserError naming a bad value otherwise.

    ``crops_size``: ``[GLOBAL, LOCAL]``, or a list of such pairs (DINOv3's mix) with ``ratios``, one per pair.
    """
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise UserError(
            f"high_res_epochs must be an integer >= 0 (0: no high-resolution stage), got {epochs!r}"
        )
    if epochs == 0:
        return None
    sizes = [crops_size] if _is_pair(crops_size) else crops_size  # one pair, or a list of them
    if (
        not sizes
        or not isinstance(sizes, Sequence)
        or isinstance(sizes, str)
        or not all(map(_is_pair, sizes))
    ):
        raise UserError(
            f"high_res_epochs={epochs} needs high_res_crops_size: [GLOBAL, LOCAL] in pixels, e.g. [448, 192], or "
            f"a list of such pairs with high_res_crops_ratios (DINOv3: global 512-768, local 112-336), got "
            f"{crops_size!r}"
        )
    sizes = tuple((int(p[0]), int(p[1])) for p in sizes)
    if ratios is None:
        if len(sizes) > 1:
            raise UserError(
                f"high_res_crops_size has {len(sizes)} (global, local) pairs: set high_res_crops_ratios, the share "
                "of batches of each pair (DINOv3: [0.3, 0.3, 0.3, 0.05, 0.05])"
            )
        ratios = [1.0]
    if isinstance(ratios, str) or len(ratios) != len(sizes):
        raise UserError(
            f"high_res_crops_ratios needs one value per (global, local) pair of high_res_crops_size "
            f"({len(sizes)}), got {ratios!r}"
        )
    numbers = all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in ratios)
    values = [float(r) for r in ratios] if numbers else [-1.0]
    if not all(math.isfinite(r) and r >= 0 for r in values) or not sum(values) > 0:
        raise UserError(f"high_res_crops_ratios must be >= 0 with a sum > 0, got {ratios!r}")
    return CropMix(sizes, tuple(r / sum(values) for r in values))


class MixedCropsView(Dataset):
    """``view[(index, pair)]``: item ``index`` of ``dataset`` cropped by ``transforms[pair]``, the key a
    ``ResumableSampler`` with ``batch_pairs`` yields (every item of a batch has its pair)."""

    def __init__(self, dataset: ImageDataset, transforms: Sequence[Callable[..., Any]]) -> None:
        self.dataset, self.transforms = dataset, list(transforms)

    @property
    def transform(self) -> Callable[..., Any]:
        """The first pair's (every pair's transform is of one kind: ``build_loader`` picks the collation by it)."""
        return self.transforms[0]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> tuple[Any, int, int] | None:
        index, pair = key
        return self.dataset.load(index, self.transforms[pair])


def in_high_res_stage(epoch: int, max_epochs: int | None, stage_epochs: int) -> bool:
    """Whether ``epoch`` (0-based) is one of the last ``stage_epochs`` of ``max_epochs``."""
    if stage_epochs <= 0:
        return False
    if max_epochs is None or max_epochs < 1:
        raise UserError(
            f"high_res_epochs={stage_epochs} counts back from trainer.max_epochs, which is not set "
            f"({max_epochs!r}): set trainer.max_epochs"
        )
    if stage_epochs >= max_epochs:
        raise UserError(
            f"high_res_epochs={stage_epochs} must be fewer than trainer.max_epochs={max_epochs} (the stage ends a run)"
        )
    return epoch >= max_epochs - stage_epochs
