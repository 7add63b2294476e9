"""The crop objects of a training stage, and DINOv3's high-resolution adaptation: larger crops for the last epochs.

DINOv3 ends its training with a short stage at higher resolution (``dinov3_vit7b16_high_res_adapt.yaml``: 30k
iterations after the main run, global crops of 512 or 768 px instead of 256, local crops of 112 to 336 px instead
of 112, the Gram teacher on 1.5x larger crops): dense features then hold up at the sizes they are used at. Here
the stage is the last ``high_res_epochs`` epochs of the fit, with one (global, local) size pair; the datamodule
builds the stage's loader when its epoch starts (``reload_dataloaders_every_n_epochs``). The stage is a function
of the epoch alone, so every rank is in the same stage, and a run resumed mid-stage rebuilds the stage's crops.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ssl_xcit.data.crops import MultiCropGeometry
from ssl_xcit.data.device_crops import CropReader
from ssl_xcit.data.transforms import MultiCropTransform
from ssl_xcit.errors import UserError


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


def check_high_res(epochs: int, crops_size: Any) -> tuple[int, int] | None:
    """``(global, local)`` sizes of the high-resolution stage, None when off; a one-line UserError otherwise."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise UserError(
            f"high_res_epochs must be an integer >= 0 (0: no high-resolution stage), got {epochs!r}"
        )
    if epochs == 0:
        return None
    if (
        crops_size is None
        or len(crops_size) != 2
        or not all(isinstance(s, int) and s > 0 for s in crops_size)
    ):
        raise UserError(
            f"high_res_epochs={epochs} needs high_res_crops_size: [GLOBAL, LOCAL] in pixels, e.g. [448, 192] "
            f"(DINOv3: global 512-768, local 112-336), got {crops_size!r}"
        )
    return int(crops_size[0]), int(crops_size[1])


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
