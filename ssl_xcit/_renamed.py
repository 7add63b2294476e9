"""Old module paths that saved run configs and recipes still name, each answered by the module that holds its
classes now, with a ``DeprecationWarning``.

A config's ``class_path: ssl_xcit.dino.callbacks.OnlineKNN`` is resolved by importing ``ssl_xcit.dino.callbacks``
(LightningCLI through jsonargparse, ``importlib.import_module``). No file is left at an old path: the finder
installed by ``ssl_xcit/__init__.py`` answers an old name with a module of that name whose attributes are the new
module's (``OnlineKNN`` there *is* ``ssl_xcit.trainer.callbacks.OnlineKNN``), and importing it warns. So a package
never imports a higher one just to keep an old name alive (tests/test_import_order.py), and the table below is
the one place the old names are listed. This module imports nothing of ``ssl_xcit`` until an old name is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

# old module -> (module holding its classes now, the warning's text). From the git history: ssl_xcit.dino's run
# machinery moved to ssl_xcit.trainer (commit a681dc7), RankMe and FSDP2Strategy too (on their branches), then
# FSDP2 to ssl_xcit.parallel and the collapse guard back to ssl_xcit.dino (it reads the objective's outputs).
# ssl_xcit.dino.checkpointing's DINOCheckpoint (removed in commit 58ca76d) is a deprecated stand-in in
# ssl_xcit.trainer.checkpointing.
RENAMED: dict[str, tuple[str, str]] = {
    "ssl_xcit.dino.callbacks": (
        "ssl_xcit.trainer.callbacks",
        "ssl_xcit.dino.callbacks is deprecated: the class is ssl_xcit.trainer.callbacks.OnlineKNN",
    ),
    "ssl_xcit.dino.checkpointing": (
        "ssl_xcit.trainer.checkpointing",
        "ssl_xcit.dino.checkpointing is deprecated: the class is "
        "ssl_xcit.trainer.checkpointing.AtomicCheckpointIO, and DINOCheckpoint is replaced by stock "
        "lightning.pytorch.callbacks.ModelCheckpoint instances (recipes/quickstart.yaml)",
    ),
    "ssl_xcit.dino.fsdp": (
        "ssl_xcit.parallel.fsdp",
        "ssl_xcit.dino.fsdp is deprecated: the class is ssl_xcit.parallel.fsdp.FSDP2Strategy",
    ),
    "ssl_xcit.dino.preemption": (
        "ssl_xcit.trainer.preemption",
        "ssl_xcit.dino.preemption is deprecated: the class is ssl_xcit.trainer.preemption.PreemptionCheckpoint",
    ),
    "ssl_xcit.dino.progress": (
        "ssl_xcit.trainer.progress",
        "ssl_xcit.dino.progress is deprecated: the class is ssl_xcit.trainer.progress.SyncedRichProgressBar",
    ),
    "ssl_xcit.dino.rankme": (
        "ssl_xcit.trainer.rankme",
        "ssl_xcit.dino.rankme is deprecated: the class is ssl_xcit.trainer.rankme.RankMe",
    ),
    "ssl_xcit.trainer.collapse": (
        "ssl_xcit.dino.collapse",
        "ssl_xcit.trainer.collapse is deprecated: the class is ssl_xcit.dino.collapse.CollapseGuard",
    ),
}


class RenamedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names of :data:`RENAMED` and loads each as a module that reads its attributes from the new
    module. ``importlib.reload`` of such a module runs its loading again, warning again."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None):
        if fullname not in RENAMED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin=f"renamed to {RENAMED[fullname][0]}")

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        new_name, message = RENAMED[module.__name__]
        new = importlib.import_module(new_name)
        module.__doc__ = f"Deprecated: the old name of {new_name}. {message}."
        own = [
            n
            for n, v in vars(new).items()
            if not n.startswith("_") and getattr(v, "__module__", "") == new_name
        ]
        module.__all__ = list(getattr(new, "__all__", own))
        module.__getattr__ = lambda name: getattr(new, name)
        module.__dir__ = lambda: sorted(set(dir(new)))
        # stacklevel 2 skips importlib's frames: the warning names the line that imported the old name.
        warnings.warn(message, DeprecationWarning, stacklevel=2)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once), ahead of the path finder: an old name never reaches a
    stale file at its old path."""
    if not any(isinstance(finder, RenamedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, RenamedModules())
