"""What the benchmark tests share: a ``benchmarks/`` script loaded as a module, the ``python benchmarks/<script>``
commands of docs/ (the commands each measured table names), and RankMe computed in numpy."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path
from types import ModuleType

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def load_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def doc_commands(script: str) -> list[list[str]]:
    """Every ``python benchmarks/<script>`` code span of docs/*.md (spans may wrap across lines), as argv."""
    found = []
    for page in sorted((REPO / "docs").glob("*.md")):
        for span in re.findall(rf"`python\s+benchmarks/{re.escape(script)}\s+([^`]*)`", page.read_text()):
            found.append(shlex.split(" ".join(span.split())))
    return found


def numpy_rankme(x: np.ndarray, eps: float = 1e-7) -> float:
    """RankMe from numpy's singular values: exp of the entropy of sigma / sum(sigma) + eps."""
    sigma = np.linalg.svd(x, compute_uv=False)
    p = sigma / sigma.sum() + eps
    return float(np.exp(-(p * np.log(p)).sum()))
