"""The checkpoint callbacks of the recipes (:func:`dino_checkpoints`), and the checkpoint IO they write through.

:class:`AtomicCheckpointIO` and :func:`last_checkpoint` live in ``ssl_xcit.parallel.checkpoint_io`` (below the
objective, whose ``setup`` installs the IO); they are re-exported here because saved run configs
(``trainer.plugins``) name ``ssl_xcit.trainer.checkpointing.AtomicCheckpointIO``. :class:`DINOCheckpoint` is the
deprecated callback that configs saved before commit 58ca76d name by its old path
``ssl_xcit.dino.checkpointing.DINOCheckpoint`` (``ssl_xcit._renamed`` points that module here).
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint

from ssl_xcit.errors import UserError
from ssl_xcit.parallel.checkpoint_io import AtomicCheckpointIO, last_checkpoint

__all__ = ["AtomicCheckpointIO", "DINOCheckpoint", "dino_checkpoints", "last_checkpoint"]


def dino_checkpoints(
    dirpath: _PATH | None = None,
    every_n_epochs: int = 20,
    filename: str = "{epoch:04d}",
    every_n_train_steps: int | None = None,
) -> list[ModelCheckpoint]:
    """Stock ``ModelCheckpoint`` instances for DINO: ``last.ckpt`` rewritten after every epoch (for
    ``--ckpt_path last``) and, with ``every_n_train_steps``, every that many optimiser steps too (a resume from
    it continues the epoch exactly: docs/cluster.md), and a kept ``epoch=NNNN.ckpt`` every ``every_n_epochs``
    epochs. No metric is monitored (the DINO loss is not a model-selection signal). The recipes list the same
    callbacks in YAML.

    Separate instances because Lightning's ``save_last`` only refreshes ``last.ckpt`` on epochs where a periodic
    copy is saved, and one instance cannot save both by steps and by epochs; with ``every_n_epochs=1`` one
    instance keeps the copies and the epoch's ``last.ckpt`` (two would share a callback state key).
    """
    if every_n_epochs < 1:
        raise UserError(f"every_n_epochs must be >= 1, got {every_n_epochs}")
    if every_n_train_steps is not None and every_n_train_steps < 1:
        raise UserError(f"every_n_train_steps must be >= 1 (or None for none), got {every_n_train_steps}")
    steps = []
    if every_n_train_steps is not None:
        steps = [
            ModelCheckpoint(
                dirpath=dirpath,
                filename="last",
                every_n_train_steps=every_n_train_steps,
                enable_version_counter=False,
            )
        ]
    common = dict(dirpath=dirpath, every_n_epochs=1, save_on_train_epoch_end=True)
    if every_n_epochs == 1:
        return [*steps, ModelCheckpoint(filename=filename, save_top_k=-1, save_last=True, **common)]
    # save_top_k=1 with no monitor keeps one file; a fixed name without a version counter overwrites it.
    last = ModelCheckpoint(filename="last", save_top_k=1, enable_version_counter=False, **common)
    keep = ModelCheckpoint(
        dirpath=dirpath,
        filename=filename,
        every_n_epochs=every_n_epochs,
        save_top_k=-1,
        save_on_train_epoch_end=True,
    )
    return [*steps, last, keep]


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
