"""The old home of the atomic checkpoint IO and of ``DINOCheckpoint``, kept because saved run configs name them:
``trainer.plugins`` from before the ``ssl_xcit.trainer`` package name
``ssl_xcit.dino.checkpointing.AtomicCheckpointIO``, and ``trainer.callbacks`` from before commit 58ca76d name
``ssl_xcit.dino.checkpointing.DINOCheckpoint``. New code imports ``ssl_xcit.trainer.checkpointing`` and lists
stock ``ModelCheckpoint`` instances (``recipes/quickstart.yaml``); importing this module warns."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint

from ssl_xcit.trainer.checkpointing import AtomicCheckpointIO

__all__ = ["AtomicCheckpointIO", "DINOCheckpoint"]

warnings.warn(
    "ssl_xcit.dino.checkpointing is deprecated: the class is "
    "ssl_xcit.trainer.checkpointing.AtomicCheckpointIO, and DINOCheckpoint is replaced by stock "
    "lightning.pytorch.callbacks.ModelCheckpoint instances (recipes/quickstart.yaml)",
    DeprecationWarning,
    stacklevel=2,
)


class DINOCheckpoint(ModelCheckpoint):
    """Deprecated: the recipes' checkpoint callback before commit 58ca76d, kept so that configs saved then still
    build. Recipes now list three stock ``ModelCheckpoint`` instances instead (``recipes/quickstart.yaml``: a
    ``last.ckpt`` every N optimiser steps, a ``last.ckpt`` after every epoch, a kept ``{epoch:04d}`` copy every
    N epochs); ``ssl_xcit.trainer.checkpointing.dino_checkpoints`` builds the same from Python.

    The old schedule, saved at the end of each training epoch: ``last.ckpt`` rewritten after *every* epoch (stock
    ``save_last`` only refreshes it on epochs that save a periodic copy), a kept ``epoch=NNNN.ckpt`` (0-based
    epoch index) every ``every_n_epochs`` epochs and after the final epoch of ``max_epochs``, every copy kept
    (``save_top_k=-1``), no metric monitored, no version counter (``last.ckpt`` is overwritten in place, never
    ``last-v1.ckpt``). Give ``dirpath`` explicitly, as the old recipes did."""

    def __init__(
        self,
        dirpath: _PATH | None = None,
        filename: str = "{epoch:04d}",
        every_n_epochs: int = 20,
        save_last: bool = True,
        *,
        save_top_k: int = -1,
        save_on_train_epoch_end: bool | None = True,
        enable_version_counter: bool = False,
        **kwargs: Any,
    ) -> None:
        warnings.warn(
            "ssl_xcit.dino.checkpointing.DINOCheckpoint is deprecated: list stock "
            "lightning.pytorch.callbacks.ModelCheckpoint instances as recipes/quickstart.yaml does",
            DeprecationWarning,
            stacklevel=2,
        )
        # The old class set these three through **kwargs, where jsonargparse (which fills **kwargs from
        # ModelCheckpoint's own signature and defaults) never saw them: named here, a config gets them too.
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            every_n_epochs=every_n_epochs,
            save_last=save_last,
            save_top_k=save_top_k,
            save_on_train_epoch_end=save_on_train_epoch_end,
            enable_version_counter=enable_version_counter,
            **kwargs,
        )

    def _save_on_schedule(self, trainer: L.Trainer) -> None:
        candidates = self._monitor_candidates(trainer)
        epochs_done = trainer.current_epoch + 1
        # max_epochs is -1 (or None) for a run bounded by max_steps only: no epoch is known to be the last.
        final = trainer.max_epochs is not None and 0 < trainer.max_epochs <= epochs_done
        if (self._every_n_epochs >= 1 and epochs_done % self._every_n_epochs == 0) or final:
            self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._should_skip_saving_checkpoint(trainer) and self._should_save_on_train_epoch_end(trainer):
            self._save_on_schedule(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Only with save_on_train_epoch_end=False (or None and a validation loop that runs after the epoch).
        at_epoch_end = self._should_save_on_train_epoch_end(trainer)
        if not self._should_skip_saving_checkpoint(trainer) and not at_epoch_end:
            self._save_on_schedule(trainer)
