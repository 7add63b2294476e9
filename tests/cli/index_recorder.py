"""A callback for the pre-emption tests' ``ssl-xcit fit`` subprocesses: one JSON line per training batch
(``step``, ``epoch``, ``indices``) and one per saved checkpoint (``saved``), appended to ``$INDEX_LOG`` and
flushed at once, so the test can watch a running fit and knows what the checkpoint covered."""

from __future__ import annotations

import json
import os

import lightning as L


class IndexRecorder(L.Callback):
    def _write(self, record: dict) -> None:
        with open(os.environ["INDEX_LOG"], "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._write(
            {"step": trainer.global_step, "epoch": trainer.current_epoch, "indices": batch[2].tolist()}
        )

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self._write({"saved": trainer.global_step})
