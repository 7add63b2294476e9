"""Checkpoint IO under any strategy, knowing nothing of the objective: atomic writes that follow the umask, and
the newest checkpoint file of a run (named in the finite-loss error).

Lightning's default ``TorchCheckpointIO`` (2.6, ``lightning.fabric.utilities.cloud_io._atomic_save``) is already
atomic: it serialises the whole checkpoint into an in-memory buffer, then writes it in an fsspec transaction (a
temporary file moved into place on a local disk). :class:`AtomicCheckpointIO` writes a local checkpoint to a
temporary file in the same folder and renames it over the target (``ssl_xcit.utils.io.atomic_torch_save``)
without the in-memory copy: a kill mid-write leaves the previous checkpoint intact either way. Local files get
0666 minus the umask, or 0600 with ``SSL_XCIT_PRIVATE=1`` (``ssl_xcit.utils.io.owner_only``).

A remote ``default_root_dir`` (``s3://``, ``gs://``, any fsspec protocol but ``file``) goes through Lightning's
own IO, which writes through fsspec; ``Trainer.save_checkpoint(..., storage_options=...)`` hands its options
to that filesystem. ``DINO.setup`` (``ssl_xcit.dino.lifecycle``) installs the plugin when the Trainer uses the default checkpoint IO, so it
is on for the CLI, the Python API and tests alike.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch
from fsspec.core import url_to_fs
from fsspec.utils import get_protocol
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ssl_xcit.errors import UserError
from ssl_xcit.models.sharded import is_checkpoint
from ssl_xcit.utils.io import atomic_torch_save, owner_only

__all__ = ["AtomicCheckpointIO", "last_checkpoint"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local ``save_checkpoint`` is all-or-nothing; remote paths use Lightning's."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if get_protocol(str(path)) != "file":
            if storage_options is None:
                super().save_checkpoint(checkpoint, path)
            else:
                _save_remote(checkpoint, path, storage_options)
            return
        if storage_options is not None:
            raise UserError(
                f"storage_options are fsspec options for a remote checkpoint path (s3://, gs://, ...), but {path} "
                f"is a local path; got {storage_options!r}"
            )
        _, local = url_to_fs(str(path))  # "file:///x/last.ckpt" -> "/x/last.ckpt"
        atomic_torch_save(checkpoint, local, private=owner_only())


def _save_remote(checkpoint: dict[str, Any], path: _PATH, storage_options: dict[str, Any]) -> None:
    """Lightning's remote write (whole file in memory, one fsspec transaction) with ``storage_options`` given
    to the filesystem, which Lightning's ``TorchCheckpointIO`` refuses."""
    if not isinstance(storage_options, dict):
        raise UserError(
            f"storage_options must be a dict of fsspec filesystem options (e.g. {{'anon': False}}), "
            f"got {type(storage_options).__name__}"
        )
    fs, target = url_to_fs(str(path), **storage_options)
    fs.makedirs(os.path.dirname(target), exist_ok=True)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    with fs.transaction, fs.open(target, "wb") as handle:
        handle.write(buffer.getvalue())


def last_checkpoint(trainer: Trainer) -> str | None:
    """The newest checkpoint file of this run (its checkpoint callbacks' last and best, or the one it
    resumed from), or None."""
    candidates = []
    for cb in trainer.checkpoint_callbacks:
        for path in (getattr(cb, "last_model_path", ""), getattr(cb, "best_model_path", "")):
            if path and is_checkpoint(path):
                candidates.append(Path(path))
        # A callback names its next file before writing it: the files already in its folder count too.
        folder = getattr(cb, "dirpath", None)
        if folder and Path(folder).is_dir():
            candidates.extend(p for p in Path(folder).glob("*.ckpt") if is_checkpoint(p))
    if trainer.ckpt_path and is_checkpoint(trainer.ckpt_path):
        candidates.append(Path(trainer.ckpt_path))
    if not candidates:
        return None
    return str(max(candidates, key=lambda p: p.stat().st_mtime))
