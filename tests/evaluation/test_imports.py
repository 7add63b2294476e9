"""What ``import ssl_xcit.evaluation`` loads, as its docstring states it (a fresh interpreter per check)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _loaded(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return set(out.stdout.split())


@pytest.mark.parametrize(
    "module, present, absent",
    [
        ("ssl_xcit.evaluation", {"torch", "numpy", "timm"}, {"lightning", "faiss"}),
    ],
)
def test_evaluation_imports_what_its_docstring_says(module, present, absent):
    loaded = _loaded(module)
    assert present <= loaded, present - loaded
    assert not absent & loaded, absent & loaded
