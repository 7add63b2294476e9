"""The invariant matrix's CUDA rows for ``gpu_check.py`` (section ``matrix``): tests/invariants on the GPU.

The rows of the all-pairs design (``tests/invariants/matrix_options.py``) in ``16-mixed`` and ``bf16-mixed``,
the precisions GPUs train in: their 1-process runs on one GPU (the census of host reads per steady step, the
fused against the default optimiser, accumulation against concatenation, finite weights and the step count),
and with 2 or more GPUs their 2-process NCCL runs too (ranks equal, 2 processes = 1, resume = uninterrupted).
FSDP2's first bf16-mixed rows run the same way (NCCL on a 1-GPU mesh; 2 processes with 2 GPUs).
``--dry-run`` runs the first ``DRY_ROWS`` of each on the CPU, one process.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

MATRIX = Path(__file__).resolve().parents[1] / "tests" / "invariants" / "matrix.py"
CUDA_ROWS = 8  # the 7 16-mixed rows and a bf16-mixed one; ~20 s each on one GPU (2-3 fits)
FSDP2_ROWS = 2  # FSDP2's first bf16-mixed rows (sharded and whole checkpoints): NCCL on a 1-GPU mesh, or 2
DRY_ROWS = 1  # of each


def _matrix() -> Any:
    spec = importlib.util.spec_from_file_location("invariant_matrix", MATRIX)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("invariant_matrix", module)
    spec.loader.exec_module(module)
    return module


def cuda_rows() -> list[dict[str, str]]:
    """The design's mixed-precision rows, 16-mixed first (its GradScaler is where issue 42's errors were)."""
    matrix = _matrix()
    rows = [r for r in matrix.pairwise(matrix.AXES) if r["precision"] != "32-true"]
    return sorted(rows, key=lambda r: r["precision"] != "16-mixed")[:CUDA_ROWS]


def fsdp2_rows() -> list[dict[str, str]]:
    """FSDP2's bf16-mixed rows (its GPU precision), one of each checkpoint form first."""
    matrix = _matrix()
    rows = [
        r for r in matrix.fsdp2_design() if r["precision"] == "bf16-mixed" and not matrix.expected_refusal(r)
    ]
    firsts = [next(r for r in rows if r["strategy"] == s) for s in ("fsdp2", "fsdp2_whole")]
    return firsts[:FSDP2_ROWS]


def planned(check: Any) -> list[Any]:
    """One gpu_check row per matrix row, each run when its turn comes (its own launch, so that a row is
    recorded as soon as it ends): pass when no invariant fails (n.a. cells named in the result)."""
    gpu_check = sys.modules[type(check).__module__]  # gpu_check's Row and Planned, however it was loaded
    matrix = _matrix()
    count = DRY_ROWS if check.dry else None
    rows = cuda_rows()[:count] + fsdp2_rows()[:count]
    worlds = (2, 1) if not check.dry and torch.cuda.device_count() >= 2 else (1,)
    backend = ("nccl, " if 2 in worlds else "") + f"{check.accelerator}, {len(worlds)} run size(s)"
    out = Path(tempfile.mkdtemp(prefix="matrix_", dir=check.tmp))

    def make(row: dict[str, str]) -> Any:
        (result,) = matrix.run_matrix([row], out, check.accelerator, worlds)
        failed = [f"{c}: {d}" for c, (s, d) in result.items() if s == "FAIL"]
        passed = sum(s == "PASS" for s, _ in result.values())
        text = "; ".join(failed)[:120] if failed else f"{passed} invariants pass, {len(result) - passed} n.a."
        return gpu_check.Row(f"matrix {matrix.row_id(row)}", backend, text, "fail" if failed else "pass")

    return [gpu_check.Planned(f"matrix {matrix.row_id(r)}", backend, lambda r=r: make(r)) for r in rows]
