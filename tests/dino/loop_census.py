"""A census of the host reads in each iteration of Lightning's training epoch loop, on the CPU.

An iteration (a *window*) runs from the start of ``_TrainingEpochLoop.advance`` (Lightning's SIGTERM broadcast,
then the batch's fetch) to the start of the next one, hooks, logging, validation and checkpoints included; the
last one of an epoch ends when the epoch loop returns. On the CPU there is no device to wait for, so the census
counts the calls that would make the host wait on a GPU, what ``torch.cuda.set_sync_debug_mode("warn")`` counts
there (the same figures, site by site: ``benchmarks/sync_count.py``):

- ``read``: a scalar read (``.item()``, ``bool()``, ``float()``, ``int()``, f-strings: ``aten::_local_scalar_dense``),
  ``.tolist()``, ``.numpy()``, and a blocking copy to the host (``.cpu()``, ``.to("cpu")``, ``host.copy_(device)``),
  each of a tensor that would be on the device;
- ``shape``: an operator whose output size depends on the values (``nonzero``, boolean-mask indexing,
  ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``...);
- ``copy``: a blocking copy of host memory to a device: ``.to(device)``/``.cuda()`` without ``non_blocking=True``
  and ``device.copy_(host)`` of a host tensor, indexing a device tensor with host indices (torch copies them
  over), ``torch.tensor(data, device=<a torch.device>)`` of host data (each a pageable, synchronous copy on CUDA);
- ``collective``: a ``torch.distributed`` collective on the default group, except those the step's math needs
  (centre and Sinkhorn-Knopp all-reduces, synchronised BatchNorm, FSDP2's clip norms: ``STEP_COLLECTIVES``).

Which tensors would be on the host on a GPU run: the loader's batches until their transfer, tensors made without
a device (``torch.zeros(n)``, ``torch.tensor(data)``, ``torch.from_numpy``, ``torch.frombuffer``), copies to the
host, every result of an operator on host tensors only, the optimiser's CPU ``step`` counters and the tensors of a
gloo group of its own; a tensor copied to a device (``.to(device)``, even when that returns it unchanged, as on the
CPU) and everything else would be on the device. A copy with ``non_blocking=True`` is not counted: CUDA queues it
(from pageable memory too; pinned memory also spares the driver's staging copy).

Not counted: the loader's work inside the fetch (on a GPU run it is host work on host tensors before the
pinned copy), reads of host tensors, and Lightning's ``move_data_to_device``, which passes ``non_blocking=True``
for tensors on CUDA (it blocks only on the CPU). ``torch.full``/``torch.zeros(..., device=...)`` of a Python
number is a kernel launch, not a copy. The device augmentation (``augment_on=device``) runs in the transfer as
on a GPU, on the CPU's tensors; each window's ``device_augment`` counts the batches it cut and augmented there.

Each finding is ``(kind, site)``; ``site`` is ``file:line (function)`` of the innermost frame outside torch's
own Python wrappers, ``<- file:line`` the innermost frame of ssl_xcit or Lightning when that is another one.

API (the invariant matrix calls it too)::

    census = LoopCensus()
    with census.installed():          # patches Lightning's loop and torch while the block runs
        trainer.fit(model, loader)    # or ssl_xcit.cli.main([...]); any precision, 1 or 2 processes
    check_steady(census.windows, ALLOWANCE[precision], warmup=2, label="...")  # AssertionError naming sites
    steady_windows(census.windows)    # the iterations the allowance applies to; summary(windows) prints sites

``census_worker.main(out, images, world_size, steps, precision)`` runs the quickstart recipe under it, with
``census_worker.precision_args(precision)`` the CLI arguments of a precision (16-mixed: the CPU GradScaler).
"""

from __future__ import annotations

import functools
import traceback
import weakref
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

SHAPE_OPS = {
    "aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
    "aten::equal", "aten::repeat_interleave", "aten::nonzero_static", "aten::argwhere",
}  # fmt: skip
COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_object", "barrier",
    "reduce_scatter_tensor", "broadcast_object_list", "gather", "scatter", "reduce", "all_to_all_single",
)  # fmt: skip
# Collectives the step's math needs, by the file that calls them.
# (torch.distributed.nn's differentiable all-reduce is synchronised BatchNorm's backward.)
# Under FSDP2, the per-parameter clip's whole-gradient norms: one all-reduce of the local squared norms.
STEP_COLLECTIVES = (
    "ssl_xcit/dino/loss.py",
    "ssl_xcit/parallel/syncbn.py",
    "torch/distributed/nn/functional.py",
    "(tensor_norms)",
)
# Frames that only wrap the real call site (torch's Python tensor methods, this file).
_WRAPPERS = (
    "torch/_tensor.py", "torch/overrides.py", "torch/utils/_python_dispatch.py", "torch/_dynamo/eval_frame.py",
    "torch/_compile.py", "loop_census.py",
)  # fmt: skip
_OURS = ("ssl_xcit/", "lightning/")


def _short(filename: str) -> str:
    path = filename.replace("\\", "/")
    for root in ("site-packages/", "/ssl_xcit/", "/tests/", "/benchmarks/"):
        if root in path:
            head, tail = path.rsplit(root, 1)
            return (root.strip("/") + "/" if root != "site-packages/" else "") + tail
    return Path(path).name


def call_site() -> str:
    frames = [f for f in traceback.extract_stack()[:-1] if not any(w in f.filename for w in _WRAPPERS)]
    if not frames:
        return "?"
    inner = frames[-1]
    site = f"{_short(inner.filename)}:{inner.lineno} ({inner.name})"
    ours = next((f for f in reversed(frames) if any(o in f.filename.replace("\\", "/") for o in _OURS)), None)
    if ours is not None and ours is not inner:
        site += f" <- {_short(ours.filename)}:{ours.lineno} ({ours.name})"
    return site


_INDEX_OPS = ("aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_")
# torch functions that make a tensor on the host when no device (or the CPU's, by name) is given.
_FACTORIES = {
    "tensor", "as_tensor", "asarray", "zeros", "ones", "empty", "full", "arange", "range", "linspace", "logspace",
    "eye", "rand", "randn", "randint", "randperm", "scalar_tensor", "empty_strided", "tril_indices", "triu_indices",
}  # fmt: skip


def _tensor_args(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an operator's arguments (lists of tensors opened)."""
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [v for v in value if isinstance(v, torch.Tensor)]
    return found


class _Dispatch(TorchDispatchMode):
    def __init__(self, census: LoopCensus) -> None:
        super().__init__()
        self.census = census

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        census = self.census
        if census.counting():
            if name == "aten::_local_scalar_dense":
                if not census.is_host(args[0]):
                    census.record("read")
            elif name in SHAPE_OPS:
                if not (name == "aten::repeat_interleave" and kwargs.get("output_size")):
                    census.record("shape")
            elif name in _INDEX_OPS:
                indices = args[1] if len(args) > 1 else ()
                indices = [i for i in indices if isinstance(i, torch.Tensor)]
                if any(i.dtype in (torch.bool, torch.uint8) for i in indices):
                    census.record("shape")  # a boolean mask: nonzero inside, on the host on CUDA
                elif not census.known_host(args[0]) and any(census.known_host(i) for i in indices):
                    census.record("copy")  # host indices of a device tensor: copied over, blocking
            elif name == "aten::copy_" and not (args[2] if len(args) > 2 else kwargs.get("non_blocking")):
                dst, src = census.known_host(args[0]), census.known_host(args[1])
                if src and not dst:
                    census.record("copy")
                elif dst and not src and args[1].dim() > 0:  # a 0-d source is a scalar the host reads
                    census.record("read")
        out = func(*args, **kwargs)
        # What an operator makes of host tensors only stays on the host.
        inputs = _tensor_args(args, kwargs)
        if inputs and all(census.known_host(t) for t in inputs):
            for t in out if isinstance(out, (list, tuple)) else (out,):
                census.add_host(t)
        return out


def _names_a_device(device: Any) -> bool:
    """A ``device=`` that may be an accelerator: any ``torch.device`` (``x.device`` is one on a GPU run), a device
    string or index other than the CPU's (``"cuda"``, ``"cuda:0"``, ``0``)."""
    if isinstance(device, torch.device):
        return True
    if isinstance(device, str):
        return torch.device(device).type != "cpu"
    return isinstance(device, int) and not isinstance(device, bool)


def _to_target(census: LoopCensus, args: tuple, kwargs: dict) -> str | None:
    """Where ``Tensor.to(*args, **kwargs)`` copies: ``"host"`` (the CPU named by a string, as ``.to("cpu")``, or
    a host tensor's device), ``"device"`` (any ``torch.device``: ``self.device`` is one, the CPU's on this CPU and
    CUDA's on a GPU run) or None (a dtype only)."""
    for value in (kwargs.get("device"), *args):
        if isinstance(value, torch.Tensor):
            return "host" if census.known_host(value) else "device"
        if isinstance(value, str):
            return "device" if torch.device(value).type != "cpu" else "host"
        if isinstance(value, (torch.device, int)) and not isinstance(value, bool):
            return "device"
    return None


def _blocking(args: tuple, kwargs: dict) -> bool:
    """No ``non_blocking=True``, by keyword or in its place (``to(device, dtype, True)``, ``cuda(0, True)``)."""
    return not kwargs.get("non_blocking", False) and not any(a is True for a in args[1:4])


class _Function(TorchFunctionMode):
    def __init__(self, census: LoopCensus) -> None:
        super().__init__()
        self.census = census

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        census = self.census
        name = getattr(func, "__name__", "")
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in ("tolist", "numpy") and tensor is not None:
            if census.counting() and not census.is_host(tensor):
                census.record("read")
            return func(*args, **kwargs)
        if name in ("to", "cuda", "cpu") and tensor is not None:
            return self._copy(func, name, tensor, args, kwargs)
        if name == "new_tensor" and tensor is not None and census.counting():
            device = kwargs.get("device")
            if _names_a_device(device) or (device is None and not census.is_host(tensor)):
                census.record("copy")  # Python data copied to the device tensor's device
        out = func(*args, **kwargs)
        if func is torch.tensor or func is torch.as_tensor or func is torch.asarray:
            if _names_a_device(kwargs.get("device")):
                if census.counting():
                    census.record("copy")
                return out
        if name in _FACTORIES and getattr(func, "__module__", None) == "torch" and not args_are(out, args):
            if not _names_a_device(kwargs.get("device")):
                census.add_host(out)
        return out

    def _copy(self, func, name: str, tensor: torch.Tensor, args: tuple, kwargs: dict):
        census = self.census
        target = {"cpu": "host", "cuda": "device"}.get(name) or _to_target(census, args[1:], kwargs)
        host = census.is_host(tensor) if target is not None else False
        blocking = _blocking(args, kwargs)
        if census.counting() and target == "host" and not host and blocking:
            census.record("read")  # a device-to-host copy: the host waits for the queue
        elif census.counting() and target == "device" and blocking:
            transfer = census.in_transfer and id(tensor) in census.batch_tensors
            if (host or transfer) and "fabric/utilities/apply_func.py" not in "".join(
                f.filename for f in traceback.extract_stack()[-5:-1]
            ):
                census.record("copy")
        out = func(*args, **kwargs)
        if target == "host" and not host:
            if out is tensor:  # this CPU's device: a copy of its own, as on a GPU, so the original stays put
                out = out.clone()
            census.add_host(out)
        elif target == "device":
            census.discard_host(out)
        return out


def args_are(out: Any, args: tuple) -> bool:
    """Whether a function returned one of its arguments (``as_tensor`` of a tensor): nothing new was made."""
    return any(out is a for a in args)


class LoopCensus:
    """Counts host reads per training-loop iteration while :meth:`installed` is active; ``windows`` holds one
    dict per iteration: ``epoch``, ``batch_idx``, ``marks`` (the periodic reads that ran in it: ``sync``,
    ``log``, ``checkpoint``, ``epoch_end``) and ``found`` (the ``[kind, site]`` list)."""

    def __init__(self) -> None:
        self.windows: list[dict[str, Any]] = []
        self._window: dict[str, Any] | None = None
        self._paused = 0
        self.in_transfer = False
        self.batch_tensors: set[int] = set()
        self.device_augment = 0  # batches cut and augmented in the transfer (augment_on=device), all windows
        self._host: dict[int, weakref.ref] = {}  # host tensors by design (see the module docstring)
        self._trainer: Any = None

    # ----------------------------------------------------------------------------------------- recording
    def counting(self) -> bool:
        return self._window is not None and self._paused == 0

    def record(self, kind: str) -> None:
        self._window["found"].append([kind, call_site()])

    def add_host(self, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor):
            key, host = id(tensor), self._host
            # Dropped with the tensor (its id is then reused), unless a new one took its place meanwhile.
            host[key] = weakref.ref(tensor, lambda ref: host.get(key) is ref and host.pop(key))

    def discard_host(self, tensor: Any) -> None:
        if self.known_host(tensor):
            del self._host[id(tensor)]

    def known_host(self, tensor: Any) -> bool:
        """A host tensor by what the census saw made or copied (``is_host`` adds the step counters)."""
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def is_host(self, tensor: Any) -> bool:
        if self.known_host(tensor):
            return True
        # An optimiser step counter made during this iteration: a parameter's first step after a window of
        # accumulation, a head warm-up or a last-layer freeze (the for-loop AdamW reads it with ``.item()``).
        self._add_step_counters()
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def _add_step_counters(self) -> None:
        """Every optimiser's CPU ``step`` counters (never on a GPU unless ``capturable``/``fused``)."""
        for opt in self._trainer.optimizers if self._trainer is not None else ():
            for state in opt.state.values():
                if isinstance(state.get("step"), torch.Tensor) and state["step"].device.type == "cpu":
                    self.add_host(state["step"])

    def mark(self, what: str) -> None:
        if self._window is not None and what not in self._window["marks"]:
            self._window["marks"].append(what)

    @contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _open(self, loop: Any) -> None:
        self._close()
        trainer = self._trainer = loop.trainer
        self._add_step_counters()
        self._window = {
            "epoch": trainer.current_epoch,
            "batch_idx": loop.batch_idx + 1,
            "global_step": trainer.global_step,
            "marks": [],
            "found": [],
            "device_augment": 0,
        }

    def _close(self) -> None:
        if self._window is not None:
            self.windows.append(self._window)
        self._window = None

    # --------------------------------------------------------------------------------------------- hooks
    @contextmanager
    def installed(self):
        """Patch Lightning's loop, fetcher and logger, the DINO module's reads and ``torch.distributed``."""
        from lightning.pytorch.loops import fetchers
        from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
        from lightning.pytorch.strategies.strategy import Strategy
        from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector

        from ssl_xcit.dino.lifecycle import DINOLifecycle

        census, saved = self, []

        def patch(owner: Any, name: str, make) -> None:
            original = owner.__dict__[name]
            saved.append((owner, name, original))
            setattr(owner, name, functools.wraps(original)(make(original)))

        def advance(original):
            def wrapper(loop, *args, **kwargs):
                census._open(loop)
                return original(loop, *args, **kwargs)

            return wrapper

        def fetch(original):
            def wrapper(*args, **kwargs):
                with census.paused():
                    batch = original(*args, **kwargs)
                for tensor in _tensors(batch):  # on the host until the transfer
                    census.add_host(tensor)
                return batch

            return wrapper

        def transfer(original):
            def wrapper(strategy, batch, *args, **kwargs):
                census.batch_tensors = _tensor_ids(batch)
                census.in_transfer = True
                try:
                    moved = original(strategy, batch, *args, **kwargs)
                finally:
                    census.in_transfer = False
                # On the device now, even where this CPU returned the same tensors.
                for tensor in _tensors(moved):
                    census.discard_host(tensor)
                return moved

            return wrapper

        def marking(what):
            def make(original):
                def wrapper(*args, **kwargs):
                    census.mark(what)
                    return original(*args, **kwargs)

                return wrapper

            return make

        def read_finite(original):
            def wrapper(module, *args, **kwargs):
                if module._finite.pending:
                    census.mark("sync")
                return original(module, *args, **kwargs)

            return wrapper

        def host_made(original):
            def wrapper(*args, **kwargs):
                out = original(*args, **kwargs)
                census.add_host(out)
                return out

            return wrapper

        def device_augment(original):
            def wrapper(batch, *args, **kwargs):
                if census._window is not None and isinstance(batch, (list, tuple)) and batch:
                    if isinstance(batch[0], device_crops.CropBatch):
                        census._window["device_augment"] += 1
                return original(batch, *args, **kwargs)

            return wrapper

        def epoch_done(original):
            def wrapper(loop, *args, **kwargs):
                try:
                    return original(loop, *args, **kwargs)
                finally:
                    census._close()

            return wrapper

        def collective(name, original):
            @functools.wraps(original)
            def wrapper(*args, **kwargs):
                group = kwargs.get("group")
                if group not in (None, dist.group.WORLD):
                    # A group of its own (gloo beside NCCL): its CPU tensors stay on the host on a GPU run.
                    for tensor in args[:1]:
                        census.add_host(tensor)
                elif census.counting():
                    site = call_site()
                    if not any(path in site for path in STEP_COLLECTIVES):
                        census._window["found"].append(["collective", f"{name}: {site}"])
                return original(*args, **kwargs)

            return wrapper

        from lightning.pytorch.loops.fit_loop import _FitLoop
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        from ssl_xcit.data import datamodule_device, device_crops

        patch(_TrainingEpochLoop, "advance", advance)
        patch(_FitLoop, "on_advance_end", epoch_done)  # epoch-end hooks (k-NN) join the last iteration
        for cls in (fetchers._DataFetcher, fetchers._PrefetchDataFetcher, _BaseDataLoaderIter):
            patch(cls, "__next__", fetch)  # the loaders' work (the k-NN monitor's too) is host work
        patch(Strategy, "batch_to_device", transfer)
        patch(_LoggerConnector, "log_metrics", marking("log"))
        patch(DINOLifecycle, "_read_finite", read_finite)
        patch(DINOLifecycle, "on_save_checkpoint", marking("checkpoint"))
        patch(DINOLifecycle, "on_train_epoch_end", marking("epoch_end"))
        patch(datamodule_device, "augment_batch", device_augment)  # the hook's own name for it
        for name in ("from_numpy", "frombuffer"):  # made on the host, without a device argument to see
            original = getattr(torch, name)
            saved.append((torch, name, original))
            setattr(torch, name, functools.wraps(original)(host_made(original)))
        for name in COLLECTIVES:
            if hasattr(dist, name):
                original = getattr(dist, name)
                saved.append((dist, name, original))
                setattr(dist, name, collective(name, original))
        # CropBatch.to copies blocking to the CPU, as Lightning does, and non-blocking to an accelerator. On this
        # CPU the census asks what it would do on a GPU, so no device type counts as blocking while it runs.
        saved.append((device_crops, "_BLOCKING_DEVICE_TYPES", device_crops._BLOCKING_DEVICE_TYPES))
        device_crops._BLOCKING_DEVICE_TYPES = ()
        modes = [_Dispatch(self), _Function(self)]
        try:
            for mode in modes:
                mode.__enter__()
            yield self
        finally:
            for mode in reversed(modes):
                mode.__exit__(None, None, None)
            self._close()
            for owner, name, original in reversed(saved):
                setattr(owner, name, original)


def _tensor_ids(batch: Any) -> set[int]:
    """The ids of every tensor in a batch (``_tensors``)."""
    return {id(t) for t in _tensors(batch)}


def _tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor in a batch: lists, tuples, dicts and objects (a ``CropBatch``) walked."""
    found: list[torch.Tensor] = []
    todo, seen = [batch], set()
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            todo.extend(vars(item).values())
    return found


# Host reads allowed per steady iteration of the quickstart loop, by Trainer precision ("16-mixed" with a
# GradScaler: fused AdamW, the toolkit's default there, takes found_inf on the device).
ALLOWANCE = {"32-true": 0, "bf16-mixed": 0, "16-mixed": 0}


def steady_windows(windows: list[dict[str, Any]], warmup: int = 2) -> list[dict[str, Any]]:
    """The steady iterations: after the first ``warmup`` (optimiser state, the first schedules are made there),
    with no periodic read marked in them."""
    return [w for w in windows if w["batch_idx"] >= warmup and not w["marks"]]


def check_steady(windows: list[dict[str, Any]], allowance: int = 0, warmup: int = 2, label: str = "") -> None:
    """AssertionError, naming every site, when a steady iteration reads the host more than ``allowance`` times."""
    bad = [w for w in steady_windows(windows, warmup) if len(w["found"]) > allowance]
    where = ", ".join(f"{w['epoch']}/{w['batch_idx']}" for w in bad)
    assert not bad, (
        f"{label}: more than {allowance} host reads in {len(bad)} steady iterations (epoch/batch {where}):\n"
        f"{summary(bad)}\nevery site of the run:\n{summary(windows)}"
    )


def summary(windows: list[dict[str, Any]]) -> str:
    """Every call site found, with its count and the iterations it ran in."""
    sites: Counter = Counter()
    where: dict[tuple[str, str], list[str]] = {}
    for w in windows:
        for kind, site in w["found"]:
            sites[(kind, site)] += 1
            where.setdefault((kind, site), []).append(f"{w['epoch']}/{w['batch_idx']}")
    lines = [
        f"  {n:4d} x {kind:10s} {site}   [epoch/batch {', '.join(sorted(set(where[(kind, site)]))[:6])}]"
        for (kind, site), n in sites.most_common()
    ]
    return "\n".join(lines) or "  none"
