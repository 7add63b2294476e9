"""The tiny models, data and launcher of tests/dino/conftest.py, shared with the trainer's tests.

tests/ has no packages, so that file is loaded by path under its own name; the tests here (and
``preemption_worker.py``, which a subprocess runs with this folder on ``sys.path``) import them from ``conftest``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _load_dino_conftest():
    name = "_ssl_xcit_tests_dino_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).parents[1] / "dino" / "conftest.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_dino = _load_dino_conftest()
RandomCrops = _dino.RandomCrops
tiny_model = _dino.tiny_model
tiny_trainer = _dino.tiny_trainer
tiny_loader = _dino.tiny_loader
torchrun = _dino.torchrun
tiny = _dino.tiny
knn_top1 = _dino.knn_top1
