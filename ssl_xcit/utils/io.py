"""Atomic file writes and content hashes.

Every checkpoint, cache and result file goes through :func:`atomic_write`: the bytes land in a temporary file
in the same folder, are flushed to disk, then renamed over the target. A rename within one file system is
atomic, so a run killed mid-write leaves either the old file or the new one, never half of one.

File modes: every file gets the mode ``open()`` would give (0666 minus the umask; ``mkstemp`` alone would make
every file 0600) and every folder ``mkdir``'s (0777 minus the umask), as with any other tool: with a umask of
027 a colleague in the group can read a checkpoint. ``private=True`` makes the file 0600 and a folder it has to
create 0700. The writers of weights (checkpoints, exported backbones, feature caches) pass
``private=owner_only()``: owner-only when ``SSL_XCIT_PRIVATE=1``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

from ssl_xcit.errors import UserError

PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700
PRIVATE_ENV = "SSL_XCIT_PRIVATE"


def owner_only() -> bool:
    """Whether checkpoints, exported weights and feature caches are written owner-only: ``SSL_XCIT_PRIVATE=1``.

    An environment variable, so it reaches every writer, the processes a launcher starts and the Python API.
    Unset, empty or ``0``: the umask decides, as for any other file.
    """
    value = os.environ.get(PRIVATE_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise UserError(f"{PRIVATE_ENV} must be 1 (owner-only files) or 0 (follow the umask), got {value!r}")
    return value == "1"


def current_umask() -> int:
    """The process umask (read by setting it and putting it back: there is no read-only call)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def make_dir(path: str | os.PathLike, private: bool = False) -> Path:
    """Create ``path`` and missing parents (0777 minus the umask); with ``private`` ``path`` itself is 0700.

    An existing folder is left as it is.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=PRIVATE_DIR if private else 0o777)
    return path


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", private: bool = False) -> Iterator[IO[Any]]:
    """Open a temporary file next to ``path``; on a clean exit it replaces ``path``, on error it is removed.

    The file gets ``open()``'s mode (0666 minus the umask), or 0600 with ``private`` (see the module doc).
    """
    path = Path(path)
    make_dir(path.parent, private)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, PRIVATE_FILE if private else 0o666 & ~current_umask())
        with os.fdopen(fd, mode) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_torch_save(obj: Any, path: str | os.PathLike, private: bool = False) -> Path:
    """``torch.save`` that never leaves a truncated file behind (0600 with ``private``)."""
    with atomic_write(path, "wb", private=private) as handle:
        torch.save(obj, handle)
    return Path(path)


def atomic_write_json(obj: Any, path: str | os.PathLike, indent: int = 2) -> Path:
    """Write ``obj`` as JSON atomically."""
    with atomic_write(path, "w") as handle:
        json.dump(obj, handle, indent=indent, sort_keys=True, default=str)
        handle.write("\n")
    return Path(path)


def sha256_file(path: str | os.PathLike, chunk_size: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's content (used to key caches on a checkpoint)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(chunk_size), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_json(obj: Any) -> str:
    """Stable hash of a JSON-serialisable description (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()
