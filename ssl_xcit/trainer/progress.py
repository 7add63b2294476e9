"""A progress bar that never makes the host wait for the device.

Lightning's bars show ``trainer.progress_bar_metrics`` on every batch: each value logged with ``prog_bar=True``
is read with ``.item()``, so each batch waits for the GPU queue to drain. DINO logs its training loss without
``prog_bar`` and publishes host values in ``progress_values`` when it reads the device anyway (every
``sync_every_n_steps`` steps, before a checkpoint, at each epoch's end: ``ssl_xcit.parallel.step_checks``); this bar
shows those, so between reads it shows the last value read.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar


class SyncedRichProgressBar(RichProgressBar):
    """Lightning's ``RichProgressBar`` (same arguments), plus the module's ``progress_values`` (host floats:
    DINO's ``train/loss`` as of its last read). A module without them shows what Lightning's bar shows."""

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        values = super().get_metrics(trainer, pl_module)
        values.update(getattr(pl_module, "progress_values", None) or {})
        return values
