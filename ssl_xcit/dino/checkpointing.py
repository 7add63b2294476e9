"""Atomic, owner-only checkpoint writes and the checkpoint callbacks of the recipes.

Lightning's default ``TorchCheckpointIO`` (2.6, ``lightning.fabric.utilities.cloud_io._atomic_save``) is already
atomic: it serialises the whole checkpoint into an in-memory buffer, then writes it in an fsspec transaction (a
temporary file moved into place on a local disk). :class:`AtomicCheckpointIO` writes to a temporary file in the
same folder and renames it over the target (``ssl_xcit.utils.io.atomic_torch_save``) without the in-memory copy
of the checkpoint: a kill mid-write leaves the previous checkpoint intact either way. Checkpoints are written
0600 (``private``). ``DINO.setup`` installs it when the Trainer uses the
default checkpoint IO, so it is on for the CLI, the Python API and tests alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ssl_xcit.errors import UserError
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
        atomic_torch_save(checkpoint, Path(path), private=True)


def dino_checkpoints(
    dirpath: _PATH | None = None, every_n_epochs: int = 20, filename: str = "{epoch:04d}"
) -> list[ModelCheckpoint]:
    """Stock ``ModelCheckpoint`` instances for DINO: ``last.ckpt`` rewritten after every epoch (for
    ``--ckpt_path last``) and a kept ``epoch=NNNN.ckpt`` every ``every_n_epochs`` epochs. No metric is monitored
    (the DINO loss is not a model-selection signal). The recipes list the same two callbacks in YAML.

    Two instances because Lightning's ``save_last`` only refreshes ``last.ckpt`` on epochs where a periodic copy
    is saved; with ``every_n_epochs=1`` one instance does both (two would share a callback state key).
    """
    if every_n_epochs < 1:
        raise UserError(f"every_n_epochs must be >= 1, got {every_n_epochs}")
    common = dict(dirpath=dirpath, every_n_epochs=1, save_on_train_epoch_end=True)
    if every_n_epochs == 1:
        return [ModelCheckpoint(filename=filename, save_top_k=-1, save_last=True, **common)]
    # save_top_k=1 with no monitor keeps one file; a fixed name without a version counter overwrites it.
    last = ModelCheckpoint(filename="last", save_top_k=1, enable_version_counter=False, **common)
    keep = ModelCheckpoint(
        dirpath=dirpath,
        filename=filename,
        every_n_epochs=every_n_epochs,
        save_top_k=-1,
        save_on_train_epoch_end=True,
    )
    return [last, keep]
