"""Sharded checkpoints (``--trainer.strategy fsdp2``): a folder of torch distributed checkpoint (DCP) shards,
one ``__<rank>_0.distcp`` per rank and the index ``.metadata``, plus Lightning's ``meta.pt`` (everything that
is not a tensor of the model or the optimiser: epoch, loops, hyperparameters, RNG states).

:func:`read_sharded_checkpoint` assembles it into the dict a one-file Lightning checkpoint holds, on one
process with no process group, so ``ssl-xcit export``, ``knn`` and ``--model.init_from`` read either form;
:func:`gather_checkpoint` writes that dict as one file (``ssl-xcit gather-checkpoint SRC OUT``). It also takes
a DCP folder of another trainer (no ``meta.pt``; DINOv3's training checkpoints, whose users asked for a way to
one file in dinov3 issue 268) and writes its whole state dict, nested as saved.

DCP reads its ``.metadata`` index with Python's full unpickler. It is first read here by an unpickler that
builds only DCP's own metadata classes and a few torch and standard-library types (the "restricting globals"
pattern of the ``pickle`` documentation), so an index that would import anything else is refused unless the
checkpoint is trusted (``--trust-checkpoint``), as a ``.ckpt`` with an unsafe pickle is.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from ssl_xcit.errors import UserError

META_FILE = "meta.pt"  # Lightning's name for the non-tensor part (lightning.fabric.strategies.fsdp)
INDEX_FILE = ".metadata"  # DCP's index
_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder holding a sharded Lightning checkpoint."""
    path = Path(path)
    return path.is_dir() and (path / INDEX_FILE).is_file() and (path / META_FILE).is_file()


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = module in _ALLOWED_MODULES or (module, name) in _ALLOWED
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")
        return super().find_class(module, name)


def check_index(path: Path) -> None:
    """Refuse a DCP index whose pickle imports anything outside the allow-list (a one-line UserError)."""
    try:
        with open(path / INDEX_FILE, "rb") as handle:
            _IndexUnpickler(handle).load()
    except pickle.UnpicklingError as error:
        raise UserError(
            f"refusing to read sharded checkpoint {path}: its {INDEX_FILE} holds {error}, outside the allow-list "
            "of DCP's metadata, and loading it could run code. If you trust it, pass --trust-checkpoint"
        ) from error
    except Exception as error:  # noqa: BLE001 - a truncated or foreign file
        raise UserError(f"cannot read sharded checkpoint {path}: {INDEX_FILE}: {error}") from error


def read_sharded_checkpoint(path: str | os.PathLike, trust: bool = False) -> dict[str, Any]:
    """The sharded checkpoint at ``path`` as one Lightning checkpoint dict on the CPU: ``meta.pt``'s entries,
    the whole ``state_dict`` and the optimiser state (keyed by parameter name, as FSDP2's full state dicts)
    under ``optimizer_states``."""
    from ssl_xcit.models.checkpoint import read_checkpoint

    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise UserError(f"{path} is not a sharded checkpoint (a folder with {INDEX_FILE} and {META_FILE})")
    tensors = read_dcp_folder(path, trust)  # the index is checked before meta.pt is unpickled
    checkpoint = dict(read_checkpoint(path / META_FILE, trust))
    checkpoint["state_dict"] = tensors.pop("state_dict")
    optimizers = sorted(k for k in tensors if k.startswith("optimizer_"))
    checkpoint["optimizer_states"] = [tensors[k] for k in optimizers]
    return checkpoint


def read_dcp_folder(path: str | os.PathLike, trust: bool = False) -> dict[str, Any]:
    """Every tensor (and value) of any DCP folder, whole, nested as it was saved, on the CPU."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ssl_xcit.models.checkpoint import TRUST_FROM_CLI

    path = Path(path)
    if not (path.is_dir() and (path / INDEX_FILE).is_file()):
        raise UserError(
            f"{path} is not a sharded checkpoint: a folder with {INDEX_FILE} and __<rank>_0.distcp files"
        )
    if not (trust or TRUST_FROM_CLI):
        check_index(path)
    buffer = io.BytesIO()  # DCP's own single-process reader; the tensors then load weights-only
    dcp_to_torch_save(path, buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location="cpu", weights_only=True)


def gather_checkpoint(source: str | os.PathLike, out: str | os.PathLike, trust: bool = False) -> Path:
    """Write the sharded checkpoint ``source`` as the one file ``out`` (atomically); returns ``out``. For a
    folder of ``--trainer.strategy fsdp2`` the file is what ``fsdp2_whole`` writes: every command reads it, and
    an FSDP2 run resumes from it. For another trainer's DCP folder, its whole state dict as saved."""
    from ssl_xcit.utils.io import atomic_torch_save, owner_only

    out = Path(out)
    if out.exists() and out.is_dir():
        raise UserError(f"output {out} is a folder; name the one file to write, e.g. {out}.ckpt")
    if is_sharded_checkpoint(source):
        checkpoint = read_sharded_checkpoint(source, trust)
    else:
        checkpoint = read_dcp_folder(source, trust)
    atomic_torch_save(checkpoint, out, private=owner_only())
    return out


def is_checkpoint(path: str | os.PathLike) -> bool:
    """A checkpoint file, or a sharded checkpoint folder: what the commands accept as weights."""
    return Path(path).is_file() or is_sharded_checkpoint(path)
