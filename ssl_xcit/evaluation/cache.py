"""On-disk cache of extracted features, keyed on everything that determines them.

A cache entry is one file ``<cache_dir>/<name>-<sha256(meta)[:16]>.pt`` holding ``{"meta": meta, "tensors": ...}``.
``meta`` is a JSON-able description of the inputs: the weights (a checkpoint's sha256, or
:func:`module_fingerprint` of a module passed in: its class, structure and every tensor), model name,
transform, dataset file list fingerprint, feature type, numeric precision, :func:`library_versions` (torch,
torchvision, Pillow, timm: decoding, resizing and the kernels), :func:`source_fingerprint` of our own code on
the path from file to tensor (decoding, resizing), and :func:`code_fingerprint` (the model code). Because the
file name hashes ``meta`` AND the stored ``meta`` is compared in full on load, a change in any input looks up a
different file: a stale entry can never be served. Entries are written atomically (temporary file + rename),
so a killed run leaves no half-written cache.

Old entries for the same ``name`` are kept (switching back to a previous checkpoint is then instant again);
delete the folder to reclaim space.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import PIL
import timm
import torch
import torchvision
from torch import nn

from ssl_xcit.models.sharded import is_sharded_checkpoint
from ssl_xcit.utils.io import atomic_torch_save, owner_only, sha256_file, sha256_json

__all__ = [
    "CACHE_FORMAT",
    "default_cache_dir",
    "cache_path",
    "load_cached",
    "save_cached",
    "files_fingerprint",
    "checkpoint_fingerprint",
    "module_fingerprint",
    "code_fingerprint",
    "library_versions",
    "source_fingerprint",
    "precision_key",
]

# Bumped when the layout of cache files or the meaning of a field changes, so old files are not reused.
CACHE_FORMAT = 1
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def default_cache_dir() -> Path:
    """``$SSL_XCIT_CACHE/features`` or ``~/.cache/ssl_xcit/features``."""
    root = os.environ.get("SSL_XCIT_CACHE") or Path.home() / ".cache" / "ssl_xcit"
    return Path(root) / "features"


def _normalise_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    # A JSON round trip makes tuples lists and Paths strings, so the comparison on load is exact.
    return json.loads(json.dumps({**meta, "cache_format": CACHE_FORMAT}, sort_keys=True, default=str))


def cache_path(cache_dir: str | os.PathLike, name: str, meta: Mapping[str, Any]) -> Path:
    """The file that holds (or will hold) the entry ``name`` for ``meta``."""
    safe = _SAFE.sub("_", name).strip("_") or "features"
    return Path(cache_dir) / f"{safe}-{sha256_json(_normalise_meta(meta))[:16]}.pt"


def load_cached(
    cache_dir: str | os.PathLike, name: str, meta: Mapping[str, Any]
) -> dict[str, torch.Tensor] | None:
    """The cached tensors for exactly this ``meta``, or None (missing, different meta, or unreadable)."""
    path = cache_path(cache_dir, name, meta)
    if not path.is_file():
        return None
    try:
        entry = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated/foreign file is a cache miss, never a crash
        warnings.warn(f"ignoring unreadable feature cache {path}: {err}", stacklevel=2)
        return None
    if not isinstance(entry, dict) or entry.get("meta") != _normalise_meta(meta):
        return None
    return dict(entry["tensors"])


def save_cached(
    cache_dir: str | os.PathLike, name: str, meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> Path:
    """Store ``tensors`` under ``name`` for ``meta`` (atomic write); returns the file written."""
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"cache entry {key!r} must be a tensor, got {type(value).__name__}")
    path = cache_path(cache_dir, name, meta)
    entry = {
        "meta": _normalise_meta(meta),
        "tensors": {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
    }
    return atomic_torch_save(entry, path, private=owner_only())


def files_fingerprint(paths: Iterable[str | os.PathLike], labels: Iterable[int] | None = None) -> str:
    """Hash of a dataset's file list: path, size and mtime of every file (and its label when given).

    Cheap (one ``stat`` per file, no reads), and any added, removed, renamed, relabelled or rewritten file
    changes it. Missing files hash as size -1 so the hash is defined; the data loader reports them.
    """
    entries = []
    label_list = list(labels) if labels is not None else None
    for i, p in enumerate(paths):
        p = os.fspath(p)
        try:
            st = os.stat(p)
            stat = (st.st_size, st.st_mtime_ns)
        except OSError:
            stat = (-1, -1)
        entries.append([os.path.abspath(p), *stat, label_list[i] if label_list is not None else None])
    return sha256_json(entries)


# (path, size, mtime_ns) -> sha256: hashing a 1 GB checkpoint takes seconds, so do it once per process.
_CKPT_HASHES: dict[tuple[str, int, int], str] = {}


def checkpoint_fingerprint(weights: str | os.PathLike | None) -> str | None:
    """sha256 of the checkpoint's bytes (None for a random-init backbone)."""
    if weights is None:
        return None
    path = Path(weights)
    if is_sharded_checkpoint(path):  # a folder of FSDP2 shards: the hash of its files' names and hashes
        parts = [f"{p.name}:{checkpoint_fingerprint(p)}" for p in sorted(path.iterdir()) if p.is_file()]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()
    if not path.is_file():
        raise FileNotFoundError(f"weights file not found: {path}")
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _CKPT_HASHES:
        _CKPT_HASHES[key] = sha256_file(path)
    return _CKPT_HASHES[key]


def module_fingerprint(module: nn.Module) -> str:
    """sha256 of what a module computes: its class, its structure (``repr``: layer sizes, options) and the name,
    dtype, shape and bytes of every state-dict tensor. Hashing a ViT-B's 86 M parameters takes about a second."""
    digest = hashlib.sha256()
    cls = type(module)
    digest.update(f"{cls.__module__}.{cls.__qualname__}\n{module!r}".encode())
    for key, value in module.state_dict().items():
        if not isinstance(value, torch.Tensor):  # a module's extra state
            digest.update(f"{key} {value!r}".encode())
            continue
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{key} {tensor.dtype} {tuple(tensor.shape)}".encode())
        # the raw bytes, viewed as uint8 because numpy has no bfloat16
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def library_versions() -> dict[str, str]:
    """Versions of the libraries that turn a file into features: Pillow (decoding, PIL resampling),
    torchvision (resize, crop, normalise), torch (every kernel) and timm (layers)."""
    return {
        "Pillow": PIL.__version__,
        "timm": timm.__version__,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
    }


def source_fingerprint(*objects: Any) -> str:
    """sha256 of the source code of ``objects`` (functions, methods, classes or modules), each under its
    qualified name. An object without readable source (built-in, C extension) counts by its name only."""
    digest = hashlib.sha256()
    for obj in objects:
        target = getattr(obj, "__func__", obj)  # a bound method: its function
        qualname = getattr(target, "__qualname__", getattr(target, "__name__", ""))
        name = f"{getattr(target, '__module__', '')}.{qualname}"
        try:
            source = inspect.getsource(target)
        except (OSError, TypeError):
            source = ""
        digest.update(f"{name}\n{source}\n".encode())
    return digest.hexdigest()


# Modules whose code determines a backbone's forward pass; any edit to them invalidates cached features.
_MODEL_CODE_PACKAGES = ("ssl_xcit.models",)


@functools.cache
def code_fingerprint() -> str:
    """sha256 of the model code: every ``ssl_xcit.models`` source file.

    Computed from the files, not from a hand-bumped number, so an upgrade that changes the forward pass can
    never be served features from the old one (a few small files: microseconds, once per process). The
    library versions are a key field of their own (:func:`library_versions`).
    """
    import importlib

    digest = hashlib.sha256()
    for name in _MODEL_CODE_PACKAGES:
        package = importlib.import_module(name)
        for path in sorted(Path(next(iter(package.__path__))).rglob("*.py")):
            digest.update(path.relative_to(Path(package.__file__).parent).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


# Lightning's short precision spellings and their canonical names; None is the Trainer default.
_PRECISION_ALIASES = {
    "None": "32-true",
    "32": "32-true",
    "16": "16-mixed",
    "bf16": "bf16-mixed",
    "64": "64-true",
}


def precision_key(precision: str | int | None) -> str:
    """The numeric setting of an extraction: Lightning precision (canonical name) and the fp32 matmul mode.

    ``torch.get_float32_matmul_precision`` matters because "high"/"medium" let fp32 matmuls run in TF32/bf16.
    """
    name = _PRECISION_ALIASES.get(str(precision), str(precision))
    return f"{name}/matmul-{torch.get_float32_matmul_precision()}"
