"""What happens to a training batch at its transfer to the device with ``augment_on=device``: the seed of its
random draws, and the decode, crops and photometric augmentation it then gets on the device.

Why each batch's generator is derived from its position instead of one generator whose state is checkpointed:
Lightning saves the checkpoint on global rank 0 and every rank loads that file, so a saved state would give
every rank rank 0's draws after a resume. The batch's position in the loop is the same on every rank and is
restored by Lightning with the loops, so a resumed run draws what the uninterrupted run drew, and ranks differ
by their rank (as the iBOT masks do). Validation batches draw from a stream of their own, keyed by the batch's
index in the pass: a validation pass leaves the training draws alone, and every pass draws the same
augmentations, so val/loss compares passes on equal inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ssl_xcit.data.device_augment import PhotometricAugment
from ssl_xcit.data.device_crops import CropBatch, CropReader, cut_crops, decode_batch

# Streams of the device augmentation's random draws: fit's training batches, validation batches, and calls
# outside a trainer's loops (benchmarks, direct calls).
TRAIN_STREAM, VAL_STREAM, OTHER_STREAM = range(3)


def loop_position(trainer: Any) -> tuple[int, int, int] | None:
    """``(stream, epoch, batch index)`` of the batch ``trainer`` is transferring in a fit or validate loop, or
    None outside them."""
    if trainer is None:
        return None
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    if fn == "fit" and trainer.training:
        # Lightning increments `ready` after the transfer: it is this batch's index in the epoch here.
        return TRAIN_STREAM, trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.ready
    if fn in ("fit", "validate") and (trainer.validating or trainer.sanity_checking):
        loop = trainer.fit_loop.epoch_loop.val_loop if fn == "fit" else trainer.validate_loop
        return VAL_STREAM, 0, loop.batch_progress.current.ready
    return None


def augment_batch(
    batch: Any,
    reader: CropReader,
    augment: PhotometricAugment,
    rng: Callable[[], np.random.Generator],
    trainer: Any,
) -> tuple[Any, int]:
    """``(batch with its crops augmented on their device, files its CropBatch left to the workers' decode)``.

    A batch that is not a multi-crop batch comes back unchanged. The float crops are in the input dtype of the
    trainer's precision (bfloat16 under ``bf16-true``, float32 under ``*-mixed``). ``rng`` is called once, for
    a batch that is augmented. With the Gram teacher's crops (``reader.geometry.gram_crops_size``) the batch's
    first item becomes ``{"crops": [...], "gram_crops": [...]}``, as on the CPU path; those are only normalised.
    """
    if not isinstance(batch, (list, tuple)) or not batch:
        return batch, 0
    crops, fallbacks, gram = batch[0], 0, 0
    if isinstance(crops, CropBatch):
        # Decode (decode_on=device) and cut the crops on the batch's device: every box and index came
        # with the batch, so nothing is read back from the device.
        images = decode_batch(crops, crops.rois.device)  # adds the files it decoded on the CPU
        fallbacks = crops.fallbacks
        sides = reader.sizes if crops.crop_sizes is None else crops.crop_sizes  # the batch's, in a size mix
        crops = cut_crops(images, crops.rois, crops.flips, sides)
        gram = reader.geometry.num_gram_crops  # cut last (MultiCropGeometry.plan)
    elif isinstance(crops, dict) and "gram_crops" in crops:  # uint8 crops already cut
        gram = len(crops["gram_crops"])
        crops = [*crops["crops"], *crops["gram_crops"]]
    if not isinstance(crops, (list, tuple)) or not all(isinstance(c, torch.Tensor) for c in crops):
        return batch, fallbacks
    augmented = augment(crops, rng(), plain=gram)
    if gram:
        augmented = {"crops": augmented[:-gram], "gram_crops": augmented[-gram:]}
    if trainer is not None:
        # Lightning converts the inputs before this hook runs, when the crops were still uint8 (and so left
        # alone): convert the float crops now, as the precision plugin would have.
        augmented = trainer.precision_plugin.convert_input(augmented)
    return [augmented, *batch[1:]], fallbacks
