"""``SkippedImagesLogger``: the data module's counts of unreadable and worker-decoded files, as logged metrics."""

from __future__ import annotations

import lightning as L


class SkippedImagesLogger(L.Callback):
    """Logs ``data/skipped_images`` (distinct unreadable files, summed over ranks) at the end of each epoch, and
    with ``decode_on=device`` ``data/cpu_decoded_images`` (files so far decoded in the workers instead)."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        count = getattr(trainer.datamodule, "num_skipped", None)
        if count is None:
            return
        pl_module.log("data/skipped_images", float(count), reduce_fx="sum", sync_dist=True, on_epoch=True)
        if (
            getattr(trainer.datamodule, "augment_on", None) == "device"
            and trainer.datamodule.reader.decode_on == "device"
        ):
            # Files decode_on=device left to the workers (not a baseline RGB/grey JPEG, or EXIF-rotated).
            fallbacks = float(trainer.datamodule.decode_fallbacks)
            pl_module.log(
                "data/cpu_decoded_images", fallbacks, reduce_fx="sum", sync_dist=True, on_epoch=True
            )
