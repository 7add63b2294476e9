"""Sharded checkpoints (``--trainer.strategy fsdp2``): a folder of torch distributed checkpoint (DCP) shards,
one ``__<rank>_0.distcp`` per rank and the index ``.metadata``, plus Lightning's ``meta.pt`` (everything that
is not a tensor of the model or the optimiser: epoch, loops, hyperparameters, RNG states).

Every read is partial: the index lists each entry with its shape and dtype, so exactly the wanted tensors are
allocated and DCP fills them on one process with no process group, one stored chunk at a time
(:func:`read_dcp_entries`, ``ssl_xcit.models.shard_reader``). The backbone readers (``ssl-xcit export``, ``knn``, ``linear``, ``embed``) read the
evaluated network's backbone (:func:`read_sharded_backbone`), ``--model.init_from`` the networks
(:func:`read_sharded_checkpoint` with ``optimizer=False``); none reads the optimiser state.
:func:`gather_checkpoint` writes the folder as one ``torch.save`` file (``ssl-xcit gather-checkpoint SRC OUT``)
as it reads it, a bounded group of tensors at a time, so a folder larger than memory can be gathered. It also
takes a DCP folder of another trainer (no ``meta.pt``; DINOv3's training checkpoints, whose users asked for a
way to one file in dinov3 issue 268) and writes its whole state dict, nested as saved.

DCP reads its ``.metadata`` index with Python's full unpickler. It is first read here by an unpickler that
builds only DCP's own metadata classes and a few torch and standard-library types (the "restricting globals"
pattern of the ``pickle`` documentation), so an index that would import anything else is refused unless the
checkpoint is trusted (``--trust-checkpoint``), as a ``.ckpt`` with an unsafe pickle is. The non-tensor entries
(an optimiser's ``param_groups``) are unpickled weights-only.
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ssl_xcit.errors import UserError

if TYPE_CHECKING:  # torch.distributed.checkpoint takes seconds to import: only the readers import it
    from torch.distributed.checkpoint.metadata import Metadata

META_FILE = "meta.pt"  # Lightning's name for the non-tensor part (lightning.fabric.strategies.fsdp)
INDEX_FILE = ".metadata"  # DCP's index
STATE = "state_dict"  # Lightning's top-level entry of the model's tensors; optimisers are optimizer_<i>
# Networks whose backbone the backbone readers take, in order of preference (ssl_xcit.models.checkpoint's
# extract_state_dict): the teacher; a distillation's student EMA (dinov3), else its student.
EVALUATED = ("teacher", "student_ema", "student")
# Bytes of tensors gather_checkpoint holds at once (a tensor larger than this is read alone).
GATHER_GROUP_BYTES = 256 << 20
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


def is_checkpoint(path: str | os.PathLike) -> bool:
    """A checkpoint file, or a sharded checkpoint folder: what the commands accept as weights."""
    return Path(path).is_file() or is_sharded_checkpoint(path)


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


def read_index(path: str | os.PathLike, trust: bool = False) -> Metadata:
    """The DCP index of the folder ``path``, checked (unless trusted) before DCP unpickles it."""
    from ssl_xcit.models import safe_load

    path = Path(path)
    if not (path.is_dir() and (path / INDEX_FILE).is_file()):
        raise UserError(
            f"{path} is not a sharded checkpoint: a folder with {INDEX_FILE} and __<rank>_0.distcp files"
        )
    if not (trust or safe_load.TRUST_FROM_CLI):
        check_index(path)
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as error:  # noqa: BLE001 - a truncated index
        raise UserError(f"cannot read sharded checkpoint {path}: {INDEX_FILE}: {error}") from error


def read_dcp_entries(
    path: str | os.PathLike, keys: Iterable[str], metadata: Metadata, trust: bool = False
) -> dict[str, Any]:
    """The entries ``keys`` (flat DCP keys, e.g. ``state_dict.teacher.backbone.cls_token``) of the folder
    ``path``, whole, on the CPU, and nothing else (``ssl_xcit.models.shard_reader``)."""
    from ssl_xcit.models import safe_load, shard_reader

    return shard_reader.read_dcp_entries(path, keys, metadata, trust or safe_load.TRUST_FROM_CLI)


def _path(metadata: Metadata, key: str) -> tuple[Any, ...]:
    """The place of a flat key in the nested state as saved (DCP's planner data), e.g. ``("state_dict",
    "teacher.backbone.cls_token")``."""
    return tuple(metadata.planner_data.get(key) or (key,)) if metadata.planner_data else (key,)


def _nest(flat: dict[str, Any], metadata: Metadata) -> dict[str, Any]:
    """Flat DCP entries nested as they were saved (integers index lists, as in an optimiser's
    ``param_groups``)."""
    root: dict[str, Any] = {}
    for key, value in flat.items():
        path = _path(metadata, key)
        node: Any = root
        for part, after in zip(path[:-1], path[1:], strict=False):
            node = _slot(node, part, [] if isinstance(after, int) else {})
        if isinstance(node, list):
            _slot(node, path[-1], None)
        node[path[-1]] = value
    return root


def _slot(node: Any, part: Any, empty: Any) -> Any:
    """``node[part]``, set to ``empty`` when absent (a list grows to hold index ``part``)."""
    if isinstance(node, list):
        node.extend(None for _ in range(part + 1 - len(node)))
        if node[part] is None:
            node[part] = empty
        return node[part]
    return node.setdefault(part, empty)


def model_keys(metadata: Metadata) -> dict[str, list[str]]:
    """``{model key: its flat DCP keys}`` for Lightning's ``state_dict`` entry: one per tensor; a module's
    extra state (a non-tensor value, or a dict of them) may have several."""
    out: dict[str, list[str]] = {}
    for key in metadata.state_dict_metadata:
        path = _path(metadata, key)
        if path[0] == STATE and len(path) >= 2:
            out.setdefault(str(path[1]), []).append(key)
    return out


def evaluated_network(keys: Iterable[str]) -> str:
    """The network whose backbone evaluation takes (``EVALUATED``), by the model keys present."""
    keys = list(keys)
    return next((n for n in EVALUATED if any(k.startswith(n + ".") for k in keys)), EVALUATED[-1])


def read_meta(path: str | os.PathLike, trust: bool = False) -> dict[str, Any]:
    """The folder's ``meta.pt`` (Lightning's non-tensor entries: hyperparameters, loops, RNG states)."""
    from ssl_xcit.models.safe_load import read_checkpoint_file

    return dict(read_checkpoint_file(Path(path) / META_FILE, trust))


def read_sharded_checkpoint(
    path: str | os.PathLike,
    trust: bool = False,
    state_keys: Callable[[str], bool] | None = None,
    optimizer: bool = True,
    backbone: bool = False,
) -> dict[str, Any]:
    """The sharded checkpoint at ``path`` as a one-file Lightning checkpoint dict on the CPU: ``meta.pt``'s
    entries, the ``state_dict`` (only the model keys ``state_keys`` accepts, when given; with ``backbone``,
    only the evaluated network's backbone, ``EVALUATED``) and, with ``optimizer``, the optimiser state (keyed
    by parameter name, as FSDP2's full state dicts) under ``optimizer_states``. Only these entries are read."""
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise UserError(f"{path} is not a sharded checkpoint (a folder with {INDEX_FILE} and {META_FILE})")
    metadata = read_index(path, trust)  # the index is checked before meta.pt is unpickled
    checkpoint = read_meta(path, trust)
    keys = model_keys(metadata)
    if backbone:
        prefix = f"{evaluated_network(keys)}.backbone."
        keys = {k: flat for k, flat in keys.items() if k.startswith(prefix)}
    wanted = [f for key, flat in keys.items() if state_keys is None or state_keys(key) for f in flat]
    if optimizer:
        wanted += [
            k for k in metadata.state_dict_metadata if str(_path(metadata, k)[0]).startswith("optimizer_")
        ]
    nested = _nest(read_dcp_entries(path, wanted, metadata, trust), metadata)
    checkpoint[STATE] = nested.pop(STATE, {})
    if optimizer:
        checkpoint["optimizer_states"] = [nested[k] for k in sorted(nested, key=_optimizer_index)]
    return checkpoint


def _optimizer_index(name: str) -> int:
    return int(name.rsplit("_", 1)[1])


def read_sharded_backbone(path: str | os.PathLike, trust: bool = False) -> dict[str, Any]:
    """:func:`read_sharded_checkpoint` with only the evaluated network's backbone (``EVALUATED``) in its
    ``state_dict``: what ``ssl-xcit export``, ``knn``, ``linear`` and ``embed`` read."""
    return read_sharded_checkpoint(path, trust, optimizer=False, backbone=True)


def read_dcp_folder(path: str | os.PathLike, trust: bool = False) -> dict[str, Any]:
    """Every tensor (and value) of any DCP folder, whole, nested as it was saved, on the CPU."""
    metadata = read_index(path, trust)
    return _nest(read_dcp_entries(path, list(metadata.state_dict_metadata), metadata, trust), metadata)


def write_sharded_checkpoint(checkpoint: dict[str, Any], folder: str | os.PathLike) -> Path:
    """Write a one-file Lightning checkpoint dict as a sharded folder on one process, in the layout Lightning's
    ``ModelParallelStrategy`` writes: ``state_dict`` and each ``optimizer_<i>`` of ``optimizer_states`` as DCP,
    the rest as ``meta.pt``. The inverse of :func:`gather_checkpoint` (for tests and benchmarks; a run writes
    its own)."""
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    rest = dict(checkpoint)
    state = {STATE: rest.pop(STATE)}
    state.update({f"optimizer_{i}": o for i, o in enumerate(rest.pop("optimizer_states", []))})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    torch.save(rest, folder / META_FILE)
    return folder


def tensor_leaves(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors of a nested checkpoint in the order ``torch.save`` pickles them (dict values, list and tuple
    items, depth first): the order of the storages in its file."""
    if isinstance(obj, dict):
        for value in obj.values():
            yield from tensor_leaves(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensor_leaves(value)
    elif isinstance(obj, torch.Tensor):
        yield obj


def _put(handle: Any, offset: int, tensor: torch.Tensor) -> None:
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    handle.seek(offset)
    handle.write(memoryview(data))


def gather_checkpoint(
    source: str | os.PathLike,
    out: str | os.PathLike,
    trust: bool = False,
    group_bytes: int = GATHER_GROUP_BYTES,
) -> Path:
    """Write the sharded checkpoint ``source`` as the one file ``out`` (atomically); returns ``out``. For a
    folder of ``--trainer.strategy fsdp2`` the file is what ``fsdp2_whole`` writes: every command reads it, and
    an FSDP2 run resumes from it. For another trainer's DCP folder, its whole state dict as saved. Tensors are
    read ``group_bytes`` at a time and written in place, so memory holds one group, never the folder. An ``out``
    ending in ``.safetensors`` holds the model's tensors only (:func:`_gather_safetensors`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ssl_xcit.models.safe_load import safe_globals
    from ssl_xcit.utils.io import atomic_write, owner_only

    out = Path(out)
    if out.exists() and out.is_dir():
        raise UserError(f"output {out} is a folder; name the one file to write, e.g. {out}.ckpt")
    source = Path(source)
    ours = is_sharded_checkpoint(source)
    metadata = read_index(source, trust)
    entries = metadata.state_dict_metadata
    tensors = [k for k, e in entries.items() if isinstance(e, TensorStorageMetadata)]
    if out.suffix.lower() == ".safetensors":
        return _gather_safetensors(source, out, metadata, tensors, ours, trust, group_bytes)
    values = read_dcp_entries(source, [k for k in entries if k not in set(tensors)], metadata, trust)
    with FakeTensorMode():  # shapes and dtypes only: the skeleton torch.save lays out
        fakes = {k: torch.empty(entries[k].size, dtype=entries[k].properties.dtype) for k in tensors}
    nested = _nest({k: fakes.get(k, values.get(k)) for k in entries}, metadata)
    if ours:
        skeleton = read_meta(source, trust)
        skeleton[STATE] = nested.pop(STATE, {})
        optimizers = sorted((k for k in nested if k.startswith("optimizer_")), key=_optimizer_index)
        skeleton["optimizer_states"] = [nested[k] for k in optimizers]
    else:
        skeleton = nested
    from_dcp = {id(fake) for fake in fakes.values()}

    with atomic_write(out, "w+b", private=owner_only()) as handle:
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(skeleton, handle)  # the layout, with room for every tensor's bytes
        handle.flush()
        handle.seek(0)
        with torch.serialization.safe_globals(safe_globals()):
            placed = torch.load(handle, map_location="meta", weights_only=True)  # where each tensor goes
        offsets = {
            id(tensor): meta.untyped_storage()._checkpoint_offset
            + meta.storage_offset() * meta.element_size()
            for tensor, meta in zip(tensor_leaves(skeleton), tensor_leaves(placed), strict=True)
        }
        for tensor in tensor_leaves(skeleton):
            if id(tensor) not in from_dcp:  # meta.pt's own tensors (RNG states), already in memory
                _put(handle, offsets[id(tensor)], tensor)
        for group in _groups(tensors, fakes, group_bytes):
            for key, tensor in read_dcp_entries(source, group, metadata, trust).items():
                _put(handle, offsets[id(fakes[key])], tensor)
    return out


# safetensors' dtype names (its format specification), for the header gather_checkpoint writes itself.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


def _gather_safetensors(
    source: Path, out: Path, metadata: Metadata, tensors: list[str], ours: bool, trust: bool, group_bytes: int
) -> Path:
    """:func:`gather_checkpoint` to a ``.safetensors`` file: the model's tensors only (no optimiser state, no
    loop state), named by model key (``teacher.backbone.cls_token``) for a folder of ours, with the backbone
    and its kwargs in the metadata as ``ssl-xcit export`` writes them, so every reader takes the file; another
    trainer's tensors named by their saved path joined with dots (``model.student.backbone...``, what
    ``--model.init_from`` reads of DINOv3's layout). The header is written from the index first, then each
    tensor's bytes in order, ``group_bytes`` at a time: safetensors' own writer needs every tensor in memory
    at once, which is what a folder larger than memory cannot give."""
    import json

    from ssl_xcit.models.export import SAFETENSORS_KWARGS_KEY, SAFETENSORS_NAME_KEY
    from ssl_xcit.utils.io import atomic_write, owner_only

    entries = metadata.state_dict_metadata
    names: dict[str, str] = {}
    for key in tensors:
        path = _path(metadata, key)
        if str(path[0]).startswith("optimizer"):
            continue
        if ours and path[0] != STATE:
            continue
        names[key] = str(path[1]) if ours else ".".join(str(p) for p in path)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    if ours:
        hparams = read_meta(source, trust).get("hyper_parameters") or {}
        if isinstance(hparams.get("backbone"), str):
            header["__metadata__"][SAFETENSORS_NAME_KEY] = hparams["backbone"]
            kwargs = dict(hparams.get("backbone_kwargs") or {})
            header["__metadata__"][SAFETENSORS_KWARGS_KEY] = json.dumps(kwargs, sort_keys=True, default=list)
    start = 0
    fakes: dict[str, torch.Tensor] = {}
    for key, name in names.items():
        entry = entries[key]
        dtype = _SAFETENSORS_DTYPES.get(entry.properties.dtype)
        if dtype is None:
            raise UserError(
                f"cannot write {name} ({entry.properties.dtype}) to safetensors, which stores "
                f"{', '.join(sorted(set(_SAFETENSORS_DTYPES.values())))}: gather to a .ckpt instead"
            )
        nbytes = torch.Size(entry.size).numel() * torch.empty((), dtype=entry.properties.dtype).element_size()
        header[name] = {"dtype": dtype, "shape": list(entry.size), "data_offsets": [start, start + nbytes]}
        fakes[key] = torch.empty(entry.size, dtype=entry.properties.dtype, device="meta")
        start += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors' writer places it
    with atomic_write(out, "wb", private=owner_only()) as handle:
        handle.write(len(text).to_bytes(8, "little") + text)
        for group in _groups(list(names), fakes, group_bytes):
            read = read_dcp_entries(source, group, metadata, trust)
            for key in group:  # in the header's order
                data = read[key].contiguous().reshape(-1).view(torch.uint8).numpy()
                handle.write(memoryview(data))
    return out


def _groups(keys: list[str], fakes: dict[str, torch.Tensor], limit: int) -> Iterator[list[str]]:
    """``keys`` in order, in groups of at most ``limit`` bytes (a larger tensor alone)."""
    group: list[str] = []
    size = 0
    for key in keys:
        nbytes = fakes[key].numel() * fakes[key].element_size()
        if group and size + nbytes > limit:
            yield group
            group, size = [], 0
        group.append(key)
        size += nbytes
    if group:
        yield group
