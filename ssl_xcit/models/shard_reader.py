"""DCP's reader for :mod:`ssl_xcit.models.sharded`'s partial reads, on its own so that the commands that only
ask whether a path is a checkpoint do not import ``torch.distributed.checkpoint`` (seconds)."""

from __future__ import annotations

import os
import pickle
import re
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ssl_xcit.errors import UserError


class ShardReader(FileSystemReader):
    """DCP's file reader with the index read once (each :func:`read_dcp_entries` call would read it again)."""

    def __init__(self, path: str | os.PathLike, metadata: Metadata) -> None:
        super().__init__(str(path))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's planner for a flat state dict, with non-tensor entries unpickled weights-only (DCP's own
    planner unpickles them fully)."""

    def __init__(self, trust: bool = False) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.trust = trust

    def load_bytes(self, read_item: Any, value: Any) -> None:
        from ssl_xcit.models.safe_load import safe_globals

        try:
            with torch.serialization.safe_globals(safe_globals()):
                loaded = torch.load(value, weights_only=not self.trust)
        except pickle.UnpicklingError as error:
            raise UserError(
                f"refusing to unpickle entry {read_item.dest_index.fqn}: it holds {_refused(error)}, outside the "
                "weights-only allow-list (or is corrupt); if you trust the checkpoint, pass --trust-checkpoint"
            ) from error
        self.state_dict[read_item.dest_index.fqn] = loaded


def read_dcp_entries(
    path: str | os.PathLike, keys: Iterable[str], metadata: Metadata, trust: bool = False
) -> dict[str, Any]:
    """The entries ``keys`` (flat DCP keys, e.g. ``state_dict.teacher.backbone.cls_token``) of the folder
    ``path``, whole, on the CPU: each tensor is allocated from the index and filled by DCP; nothing else is
    read. Non-tensor entries are unpickled weights-only unless ``trust``."""
    entries = metadata.state_dict_metadata
    targets: dict[str, Any] = {}
    for key in keys:
        entry = entries[key]
        if isinstance(entry, TensorStorageMetadata):
            targets[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
        else:
            targets[key] = None  # a pickled value (an optimiser's param_groups), filled by the planner
    if not targets:
        return targets
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # one process on purpose: DCP warns that no process group exists
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(
                targets,
                storage_reader=ShardReader(path, metadata),
                planner=_WeightsOnlyPlanner(trust),
                no_dist=True,
            )
        except (Exception, CheckpointException) as error:  # noqa: BLE001 - DCP's is a BaseException
            cause = _cause(error)
            if isinstance(cause, UserError):
                raise UserError(f"cannot read sharded checkpoint {path}: {cause}") from error
            if isinstance(cause, pickle.UnpicklingError):
                detail = (
                    f"a stored tensor does not unpickle weights-only ({_refused(cause)}): a corrupt shard?"
                )
            else:
                lines = str(cause).strip().splitlines()
                detail = f"{type(cause).__name__}: {lines[0] if lines else ''}"
            raise UserError(f"cannot read sharded checkpoint {path}: {detail}") from error
    return targets


def fill_from_dcp(path: str | os.PathLike, targets: dict[str, torch.Tensor], metadata: Metadata) -> None:
    """Copy the folder's entries into ``targets`` (flat DCP key -> a tensor of the model, in place), with DCP
    planning the reads: a sharded target (a ``DTensor``) reads only this rank's slice, a plain one the whole
    entry. A collective when a process group is initialised: every rank calls it with the same keys."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    for key, target in targets.items():
        entry = metadata.state_dict_metadata.get(key)
        if not isinstance(entry, TensorStorageMetadata) or tuple(entry.size) != tuple(target.shape):
            raise UserError(
                f"cannot read sharded checkpoint {path}: {key} is not a tensor of {tuple(target.shape)}"
            )
    with torch.no_grad():
        dcp.load(
            targets,
            storage_reader=ShardReader(path, metadata),
            planner=_WeightsOnlyPlanner(),
            no_dist=not (dist.is_available() and dist.is_initialized()),
        )


def _cause(error: BaseException) -> BaseException:
    """The reader's own exception inside DCP's ``CheckpointException`` (``failures``: rank -> (exception,
    traceback)), else ``error``."""
    failures = getattr(error, "failures", None) or {}
    for failure in failures.values():
        found = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(found, BaseException):
            return found
    return error


def _refused(error: BaseException) -> str:
    """What the weights-only unpickler refused, in a few words."""
    text = str(error)
    found = re.search(r"GLOBAL \S+|Unsupported operand \d+", text)
    return found.group(0) if found else (text.strip().splitlines() or ["?"])[0]
