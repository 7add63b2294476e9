"""A one-file SOURCE read memory-mapped, for teachers loaded into FSDP2 shards: every tensor stays a view of the
file, so a rank that cuts its shard out of each (``load_whole_state``) reads only those bytes, never the whole
network (``read_checkpoint`` reads it whole on every rank).

A safetensors file is mapped by its header (the format is a little-endian u64 header length, a JSON header
``{name: {dtype, shape, data_offsets}}`` and the raw bytes); a ``torch.save`` zip file goes through
``torch.load(mmap=True)`` with the checkpoint reader's allow-list. Anything else (a legacy pickle, a folder, a
file the safe reader refuses) gives None, and the caller reads SOURCE as before, with its one-line errors.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Any

import torch

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


def read_mapped_safetensors(path: Path) -> dict[str, Any] | None:
    """The tensors of a safetensors file as read-only views of its memory map (None: not one we map); with the
    ``{"state_dict", "hyper_parameters"}`` wrapping ``read_safetensors`` gives files of ``ssl-xcit export``."""
    from ssl_xcit.models.export import SAFETENSORS_KWARGS_KEY, SAFETENSORS_NAME_KEY, _tuples

    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return None
        (length,) = struct.unpack("<Q", head)
        try:
            header = json.loads(handle.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        # Copy on write: pages are read as touched, and a write (none is made) would stay in this process.
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    metadata = header.pop("__metadata__", None) or {}
    state = {}
    for name, info in header.items():
        dtype = _SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            return None
        begin, end = info["data_offsets"]
        count = (end - begin) // dtype.itemsize
        flat = (
            torch.frombuffer(mapped, dtype=dtype, count=count, offset=8 + length + begin) if count else None
        )
        state[name] = (
            flat.view(info["shape"]) if flat is not None else torch.empty(info["shape"], dtype=dtype)
        )
    name = metadata.get(SAFETENSORS_NAME_KEY)
    if not name:
        return state
    kwargs = _tuples(json.loads(metadata.get(SAFETENSORS_KWARGS_KEY) or "{}"))
    return {"state_dict": state, "hyper_parameters": {"backbone": name, "backbone_kwargs": kwargs}}


def read_mapped_checkpoint(source: str) -> Any | None:
    """SOURCE memory-mapped (see the module docstring), or None when it is not a file this reads."""
    import warnings

    from ssl_xcit.models.export import is_safetensors
    from ssl_xcit.models.safe_load import safe_globals

    path = Path(source)
    if not path.is_file():
        return None
    if is_safetensors(path):
        return read_mapped_safetensors(path)
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(safe_globals()):
            warnings.simplefilter("ignore")  # mapped tensors are never written here
            return torch.load(path, mmap=True, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - the caller's reader reads it again and reports in its own words
        return None
