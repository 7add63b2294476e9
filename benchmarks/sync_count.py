"""Host syncs per training step, for ``gpu_check.py``: a Lightning callback counting, in each iteration of
Lightning's training epoch loop, every call that makes the host wait for the device, with its site.

A step's window is the loop's own iteration, as the loop census's (``tests/dino/loop_census.py``): from the start
of ``_TrainingEpochLoop.advance`` (the batch's fetch, its transfer and device augmentation, the step, the batch-end
hooks, then the logging Lightning does after them) to the start of the next. A window from one batch end to the
next would count a step's own read (``sync_every_n_steps``, inside the step) in one window and the logging of the
same step (after the batch-end hooks) in the next: 3 reading steps in 12 counted as 6 syncing ones (issue 51).

On CUDA it uses torch's own detector, ``torch.cuda.set_sync_debug_mode("warn")``, and takes the Python stack of
each of its warnings: the site is the innermost frame of ssl_xcit or Lightning (else the innermost one outside
torch and the warnings machinery), ``file:line (function)``. A CPU has no device to wait for; there the loop census
counts the calls that would sync on CUDA (scalar reads, copies to the host, blocking copies to the device,
data-dependent shapes; host tensors told from the device's), by the same windows and with the same kind of site.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
import warnings
from collections import Counter
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch

REPO = Path(__file__).resolve().parents[1]
CENSUS = REPO / "tests" / "dino" / "loop_census.py"
SYNC_WARNING = "called a synchronizing CUDA operation"
_OURS = ("ssl_xcit/", "lightning/")
# Frames that only carry the warning or wrap the call: the warnings machinery, this file, torch's Python wrappers.
_CARRIERS = ("/warnings.py", "/sync_count.py", "torch/_tensor.py", "torch/overrides.py", "torch/_compile.py")


def _path(filename: str) -> str:
    return filename.replace("\\", "/")


def short(filename: str) -> str:
    """``ssl_xcit/...``, ``lightning/...``, ``torch/...``: the path from the package's folder."""
    path = _path(filename)
    for root in ("/ssl_xcit/", "site-packages/", "/tests/", "/benchmarks/"):
        if root in path:
            tail = path.rsplit(root, 1)[1]
            return tail if root == "site-packages/" else root.strip("/") + "/" + tail
    return Path(path).name


def site_of(frames: list[traceback.FrameSummary]) -> str:
    """``file:line (function)`` of the innermost ssl_xcit or Lightning frame of a stack (outermost first), else of
    its innermost frame outside the warnings machinery, torch's wrappers and this file."""
    frames = [f for f in frames if not any(c in _path(f.filename) for c in _CARRIERS)]
    if not frames:
        return "?"
    ours = next((f for f in reversed(frames) if any(o in _path(f.filename) for o in _OURS)), frames[-1])
    return f"{short(ours.filename)}:{ours.lineno} ({ours.name})"


def _load_census() -> Any:
    """``tests/dino/loop_census.py`` (the module the census test and the invariant matrix use)."""
    if "loop_census" in sys.modules:
        return sys.modules["loop_census"]
    spec = importlib.util.spec_from_file_location("loop_census", CENSUS)
    module = importlib.util.module_from_spec(spec)
    sys.modules["loop_census"] = module
    spec.loader.exec_module(module)
    return module


@contextmanager
def each_iteration(loop: Any, start: Any):
    """Calls ``start(batch_idx)`` at the start of each ``advance`` of Lightning's training epoch ``loop``."""

    def advance(*args: Any, **kwargs: Any) -> Any:
        start(loop.batch_idx + 1)  # the index of the batch this iteration fetches
        return original(*args, **kwargs)

    original = loop.advance
    loop.advance = advance  # the loop calls self.advance: this instance's own attribute comes first
    try:
        yield
    finally:
        del loop.advance


class CudaSyncs:
    """``torch.cuda.set_sync_debug_mode("warn")`` while active; each of its warnings becomes a site in
    ``found`` (a list the caller swaps per window, or None to drop them). Other warnings go on as before."""

    def __init__(self) -> None:
        self.found: list[str] | None = None

    @contextmanager
    def active(self):
        with warnings.catch_warnings():
            shown = warnings.showwarning
            warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")

            def showwarning(message, category, filename, lineno, file=None, line=None):
                if SYNC_WARNING not in str(message):
                    return shown(message, category, filename, lineno, file, line)
                if self.found is not None:
                    self.found.append(site_of(traceback.extract_stack()[:-1]))
                return None

            warnings.showwarning = showwarning
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield self
            finally:
                torch.cuda.set_sync_debug_mode(0)


class SyncCounter(L.Callback):
    """Syncs in each iteration of the training epoch loop: ``windows`` (``batch_idx`` and the ``found`` sites),
    ``per_step`` (their counts after the first ``skip`` iterations: compilation, first allocations).
    ``detector``: ``cuda`` (the sync debug mode) or ``census``; None: by the module's device."""

    def __init__(self, skip: int = 2, detector: str | None = None) -> None:
        self.skip, self.detector = skip, detector
        self.windows: list[dict[str, Any]] = []
        self.method = ""
        self._stack: ExitStack | None = None
        self._census: Any = None
        self._cuda: CudaSyncs | None = None

    @property
    def per_step(self) -> list[int]:
        return [len(w["found"]) for w in self.steps()]

    def steps(self) -> list[dict[str, Any]]:
        """The windows after the first ``skip``."""
        return [w for w in self.windows if w["batch_idx"] >= self.skip]

    def _start_window(self, batch_idx: int) -> None:
        window = {"batch_idx": batch_idx, "found": []}
        self.windows.append(window)
        self._cuda.found = window["found"] if batch_idx >= self.skip else None

    def on_train_start(self, trainer, pl_module) -> None:
        self.windows, stack = [], ExitStack()
        self._stack = stack
        if (self.detector or ("cuda" if pl_module.device.type == "cuda" else "census")) == "cuda":
            self.method = "CUDA sync debug mode"
            self._cuda = stack.enter_context(CudaSyncs().active())
            stack.enter_context(each_iteration(trainer.fit_loop.epoch_loop, self._start_window))
        else:
            self.method = "CPU census"
            self._census = _load_census().LoopCensus()
            stack.enter_context(self._census.installed())

    def _stop(self) -> None:
        if self._stack is None:
            return
        self._stack.close()
        self._stack = None
        if self._census is not None:
            # A census site is "inner <- ssl_xcit/lightning frame" (or the inner one alone): the latter, as on CUDA.
            self.windows = [
                {"batch_idx": w["batch_idx"], "found": [site.split(" <- ")[-1] for _, site in w["found"]]}
                for w in self._census.windows
            ]
        elif self._cuda is not None:
            self._cuda.found = None

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._stop()


def sites(windows: list[dict[str, Any]]) -> Counter:
    """How often each site synced in ``windows``, the line only (``file:line``)."""
    return Counter(site.split(" (")[0] for w in windows for site in w["found"])
