"""Old module paths (``ssl_xcit._renamed``): no file is left at them, importing one warns and gives the new
module's classes, and a config naming an old class path builds the new class as LightningCLI resolves it.
tests/trainer/test_compat.py checks the same against what the last release wrote."""

from __future__ import annotations

import importlib
import json
import sys
import warnings
from pathlib import Path

import jsonargparse
import lightning as L
import pytest
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import Strategy

import ssl_xcit
from ssl_xcit._renamed import RENAMED

# An old class path per old module, the class it must be now, and the base a config's class_path is checked against.
OLD_CLASSES = {
    "ssl_xcit.dino.callbacks.OnlineKNN": ("ssl_xcit.trainer.callbacks.OnlineKNN", L.Callback),
    "ssl_xcit.dino.checkpointing.AtomicCheckpointIO": (
        "ssl_xcit.trainer.checkpointing.AtomicCheckpointIO",
        CheckpointIO,
    ),
    "ssl_xcit.dino.fsdp.FSDP2Strategy": ("ssl_xcit.parallel.fsdp.FSDP2Strategy", Strategy),
    "ssl_xcit.dino.preemption.PreemptionCheckpoint": (
        "ssl_xcit.trainer.preemption.PreemptionCheckpoint",
        L.Callback,
    ),
    "ssl_xcit.dino.progress.SyncedRichProgressBar": (
        "ssl_xcit.trainer.progress.SyncedRichProgressBar",
        L.Callback,
    ),
    "ssl_xcit.dino.rankme.RankMe": ("ssl_xcit.trainer.rankme.RankMe", L.Callback),
    "ssl_xcit.trainer.collapse.CollapseGuard": ("ssl_xcit.dino.collapse.CollapseGuard", L.Callback),
}


def _resolve(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _fresh_import(name: str):
    """Import ``name`` as a process's first import of it does (the warning comes once per process)."""
    sys.modules.pop(name, None)
    __import__(name)  # as an import statement does (importlib.import_module is a frame of its own)
    return sys.modules[name]


def test_every_old_module_has_an_old_class_checked_here():
    assert {path.rpartition(".")[0] for path in OLD_CLASSES} == set(RENAMED)


def test_no_file_is_left_at_an_old_path():
    # A file there would be a module of the lower package importing the higher one it re-exports.
    root = Path(ssl_xcit.__path__[0])
    for old in RENAMED:
        assert not root.joinpath(*old.split(".")[1:]).with_suffix(".py").exists(), old


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_importing_an_old_module_warns_with_its_old_text(old):
    new, message = RENAMED[old]
    with pytest.warns(DeprecationWarning) as caught:
        module = _fresh_import(old)
    assert [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)] == [message]
    assert caught[0].filename == __file__  # the warning names the line that imported the old name
    assert module.__name__ == old and set(module.__all__) <= set(dir(importlib.import_module(new)))
    for name in module.__all__:
        assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_from_an_old_module_import_a_class():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from ssl_xcit.dino.callbacks import OnlineKNN
        from ssl_xcit.dino.checkpointing import DINOCheckpoint
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ssl_xcit.trainer.callbacks import OnlineKNN as New

    assert OnlineKNN is New and issubclass(DINOCheckpoint, ModelCheckpoint)


@pytest.mark.parametrize("old", sorted(OLD_CLASSES))
def test_a_config_naming_an_old_class_path_resolves_to_the_new_class(old):
    new, base = OLD_CLASSES[old]
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--value", type=base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        config = parser.parse_args([f"--value={json.dumps({'class_path': old})}"])  # resolves and type-checks
    assert _resolve(config.value.class_path) is _resolve(new)


def test_a_config_naming_an_old_callback_path_builds_the_new_class():
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--callback", type=L.Callback)
    value = {"class_path": "ssl_xcit.trainer.collapse.CollapseGuard", "init_args": {"patience": 7}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        callback = parser.instantiate_classes(parser.parse_args([f"--callback={json.dumps(value)}"])).callback
    assert type(callback) is _resolve("ssl_xcit.dino.collapse.CollapseGuard") and callback.patience == 7
