"""Host syncs per training step, for ``gpu_check.py``: a Lightning callback counting, from one batch end to the
next (loading, transfer, device augmentation, the step, logging), every call that makes the host wait for the
device.

On CUDA it uses torch's own detector, ``torch.cuda.set_sync_debug_mode("warn")``, and counts its warnings. A
CPU has no device to wait for; there it counts, through a ``TorchDispatchMode``, the operators that would
synchronise if their tensors were on CUDA (a scalar read such as ``.item()``/``float()``/``bool()``, and the
operators whose output shape depends on the data: ``nonzero``, boolean-mask indexing, ``masked_select``...).
That proxy cannot tell the tensors that stay on the host on a GPU run (the loader's, the RNG draws, the
optimiser's step counters) from the device's, and misses host copies (``.cpu()``): an upper bound, which
``gpu_check.py`` reports as such, never as a pass.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Operators that make the host wait on CUDA: a scalar read, or an output whose size depends on the values.
SYNCING_OPS = {
    "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_dim",
    "aten::unique_consecutive", "aten::equal", "aten::repeat_interleave", "aten::nonzero_static",
}  # fmt: skip
SYNC_WARNING = "called a synchronizing CUDA operation"


class _CountSyncingOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in SYNCING_OPS and not (
            name == "aten::repeat_interleave" and (kwargs or {}).get("output_size")
        ):
            self.count += 1
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class SyncCounter(L.Callback):
    """Syncs in each step after the first ``skip`` (warm-up: compilation, first allocations): ``per_step``."""

    def __init__(self, skip: int = 2) -> None:
        self.skip = skip
        self.per_step: list[int] = []
        self.ops: dict[str, int] = {}
        self.method = ""
        self._active: Any = None

    def _start(self, device: torch.device) -> None:
        if device.type == "cuda":
            self.method = "CUDA sync debug mode"
            self._catch = warnings.catch_warnings(record=True)
            self._records = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            self._active = "cuda"
        else:
            self.method = "CPU proxy (upper bound)"
            self._active = _CountSyncingOps()
            self._active.__enter__()

    def _stop(self) -> int:
        if self._active == "cuda":
            torch.cuda.set_sync_debug_mode(0)
            count = sum(SYNC_WARNING in str(w.message) for w in self._records)
            self._catch.__exit__(None, None, None)
        else:
            self._active.__exit__(None, None, None)
            count = self._active.count
            for name, n in self._active.ops.items():
                self.ops[name] = self.ops.get(name, 0) + n
        self._active = None
        return count

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._active is not None:
            self.per_step.append(self._stop())
        if batch_idx + 1 >= self.skip:
            self._start(pl_module.device)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._active is not None:  # a window left open after the last step: not a whole step
            self._stop()
