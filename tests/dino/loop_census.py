"""A census of the host reads in each iteration of Lightning's training epoch loop, on the CPU.

An iteration (a *window*) runs from the start of ``_TrainingEpochLoop.advance`` (Lightning's SIGTERM broadcast,
then the batch's fetch) to the start of the next one, hooks, logging, validation and checkpoints included; the
last one of an epoch ends when the epoch loop returns. On the CPU there is no device to wait for, so every one
of these calls on any tensor counts as a host read (on a GPU each one waits for the queue):

- ``read``: a scalar read (``.item()``, ``bool()``, ``float()``, ``int()``, f-strings: ``aten::_local_scalar_dense``),
  ``.tolist()``, ``.numpy()``;
- ``shape``: an operator whose output size depends on the values (``nonzero``, boolean-mask indexing...);
- ``copy``: a blocking copy to a device: ``.to(device)``/``.cuda()`` without ``non_blocking=True`` of a batch
  tensor in the transfer, ``torch.tensor(data, device=<a torch.device>)`` of host data (each a pageable,
  synchronous copy on CUDA);
- ``collective``: a ``torch.distributed`` collective on the default group, except those the step's math needs
  (centre and Sinkhorn-Knopp all-reduces, synchronised BatchNorm, FSDP2's clip norms: ``STEP_COLLECTIVES``).

Not counted: the loader's work inside the fetch (on a GPU run it is host work on host tensors before the
pinned copy), the optimiser's ``step`` counters (torch keeps them on the CPU unless ``capturable``/``fused``,
so reading them never waits on a GPU), and Lightning's ``move_data_to_device``, which passes
``non_blocking=True`` for tensors on CUDA (it blocks only on the CPU).

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
    "ssl_xcit/trainer/syncbn.py",
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


class _Dispatch(TorchDispatchMode):
    def __init__(self, census: LoopCensus) -> None:
        super().__init__()
        self.census = census

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        census = self.census
        if census.counting():
            if name == "aten::_local_scalar_dense":
                if not census.is_host(args[0]):
                    census.record("read")
            elif name in SHAPE_OPS:
                if not (name == "aten::repeat_interleave" and (kwargs or {}).get("output_size")):
                    census.record("shape")
            elif name in ("aten::index", "aten::index_put_", "aten::index_put"):
                indices = args[1] if len(args) > 1 else ()
                if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
                    census.record("shape")  # a boolean mask: nonzero inside, on the host on CUDA
        return func(*args, **(kwargs or {}))


def _device_target(args: tuple, kwargs: dict) -> bool:
    if "device" in kwargs and kwargs["device"] is not None:
        return True
    return any(isinstance(a, (str, torch.device)) for a in args)


def _names_a_device(device: Any) -> bool:
    """A ``device=`` that may be an accelerator: any ``torch.device`` (``x.device`` is one on a GPU run), a device
    string or index other than the CPU's (``"cuda"``, ``"cuda:0"``, ``0``)."""
    if isinstance(device, torch.device):
        return True
    if isinstance(device, str):
        return torch.device(device).type != "cpu"
    return isinstance(device, int) and not isinstance(device, bool)


class _Function(TorchFunctionMode):
    def __init__(self, census: LoopCensus) -> None:
        super().__init__()
        self.census = census

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        census = self.census
        if census.counting():
            name = getattr(func, "__name__", "")
            if name in ("tolist", "numpy"):
                census.record("read")
            elif name in ("to", "cuda") and args and isinstance(args[0], torch.Tensor):
                blocking = not kwargs.get("non_blocking", False) and not (
                    len(args) > 2 and isinstance(args[2], bool) and args[2]
                )
                transfer = census.in_transfer and id(args[0]) in census.batch_tensors
                if blocking and transfer and (name == "cuda" or _device_target(args[1:], kwargs)):
                    if "fabric/utilities/apply_func.py" not in "".join(
                        f.filename for f in traceback.extract_stack()[-4:-1]
                    ):
                        census.record("copy")
            elif func is torch.tensor or func is torch.as_tensor:
                if _names_a_device(kwargs.get("device")):
                    census.record("copy")
        return func(*args, **kwargs)


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
        self._host: dict[int, weakref.ref] = {}  # host tensors by design (see the module docstring)
        self._trainer: Any = None

    # ----------------------------------------------------------------------------------------- recording
    def counting(self) -> bool:
        return self._window is not None and self._paused == 0

    def record(self, kind: str) -> None:
        self._window["found"].append([kind, call_site()])

    def add_host(self, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor):
            self._host[id(tensor)] = weakref.ref(tensor)

    def is_host(self, tensor: Any) -> bool:
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

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
        for opt in trainer.optimizers:
            for state in opt.state.values():
                if isinstance(state.get("step"), torch.Tensor) and state["step"].device.type == "cpu":
                    self.add_host(state["step"])
        self._window = {
            "epoch": trainer.current_epoch,
            "batch_idx": loop.batch_idx + 1,
            "global_step": trainer.global_step,
            "marks": [],
            "found": [],
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

        from ssl_xcit.trainer.lifecycle import DINOLifecycle

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
                    return original(*args, **kwargs)

            return wrapper

        def transfer(original):
            def wrapper(strategy, batch, *args, **kwargs):
                census.batch_tensors = _tensor_ids(batch)
                census.in_transfer = True
                try:
                    return original(strategy, batch, *args, **kwargs)
                finally:
                    census.in_transfer = False

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

        patch(_TrainingEpochLoop, "advance", advance)
        patch(_FitLoop, "on_advance_end", epoch_done)  # epoch-end hooks (k-NN) join the last iteration
        for cls in (fetchers._DataFetcher, fetchers._PrefetchDataFetcher, _BaseDataLoaderIter):
            patch(cls, "__next__", fetch)  # the loaders' work (the k-NN monitor's too) is host work
        patch(Strategy, "batch_to_device", transfer)
        patch(_LoggerConnector, "log_metrics", marking("log"))
        patch(DINOLifecycle, "_read_finite", read_finite)
        patch(DINOLifecycle, "on_save_checkpoint", marking("checkpoint"))
        patch(DINOLifecycle, "on_train_epoch_end", marking("epoch_end"))
        for name in COLLECTIVES:
            if hasattr(dist, name):
                original = getattr(dist, name)
                saved.append((dist, name, original))
                setattr(dist, name, collective(name, original))
        # CropBatch.to copies blocking to the CPU, as Lightning does, and non-blocking to an accelerator. On this
        # CPU the census asks what it would do on a GPU, so no device type counts as blocking while it runs.
        from ssl_xcit.data import device_crops

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
    """The ids of every tensor in a batch: lists, tuples, dicts and objects (a ``CropBatch``) walked."""
    found: set[int] = set()
    todo, seen = [batch], set()
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            found.add(id(item))
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
