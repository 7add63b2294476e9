"""Atomic checkpoint writes and the checkpoint callback of the recipes.

Lightning's default ``TorchCheckpointIO`` (2.6, ``lightning.fabric.utilities.cloud_io._atomic_save``) is already
atomic: it serialises the whole checkpoint into an in-memory buffer, then writes it in an fsspec transaction (a
temporary file moved into place on a local disk). :class:`AtomicCheckpointIO` writes to a temporary file in the
same folder and renames it over the target (``ssl_xcit.utils.io.atomic_torch_save``) without the in-memory copy
of the checkpoint: a kill mid-write leaves the previous checkpoint intact either way. ``DINO.setup`` installs it when the Trainer uses the
default checkpoint IO, so it is on for the CLI, the Python API and tests alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ssl_xcit.utils.io import atomic_torch_save


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose ``save_checkpoint`` is all-or-nothing."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"AtomicCheckpointIO does not take storage_options, got {storage_options!r}; "
                "use a custom CheckpointIO plugin for remote storage"
            )
        atomic_torch_save(checkpoint, Path(path))


class DINOCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` with the schedule DINO wants: ``last.ckpt`` rewritten after *every* epoch (for
    ``--ckpt_path last``; Lightning's own only refreshes it when a periodic copy is saved), a kept copy every
    ``every_n_epochs`` epochs and after the final epoch, no metric monitoring (the DINO loss is not a
    model-selection signal). Give ``dirpath`` explicitly: ``--ckpt_path last`` searches it before the logger
    has picked a new version folder."""

    def __init__(
        self,
        dirpath: _PATH | None = None,
        filename: str = "{epoch:04d}",  # -> epoch=0019.ckpt
        every_n_epochs: int = 20,
        save_last: bool = True,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("save_top_k", -1)
        kwargs.setdefault("save_on_train_epoch_end", True)
        # Overwrite last.ckpt in place (atomically) instead of creating last-v1.ckpt next to a previous run's.
        kwargs.setdefault("enable_version_counter", False)
        super().__init__(
            dirpath=dirpath, filename=filename, every_n_epochs=every_n_epochs, save_last=save_last, **kwargs
        )

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._should_skip_saving_checkpoint(trainer):
            return
        candidates = self._monitor_candidates(trainer)
        epoch = trainer.current_epoch + 1
        final = trainer.max_epochs is not None and epoch >= trainer.max_epochs
        if (self._every_n_epochs >= 1 and epoch % self._every_n_epochs == 0) or final:
            self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)
