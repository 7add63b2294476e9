"""benchmarks/gpu_check_matrix.py: the invariant matrix's rows that gpu_check.sh runs on a GPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location(
        "gpu_check_matrix", REPO / "benchmarks" / "gpu_check_matrix.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cuda_rows_are_the_designs_mixed_precision_rows_16_mixed_first():
    module = _module()
    rows = module.cuda_rows()
    matrix = sys.modules["invariant_matrix"]
    design = matrix.pairwise(matrix.AXES)
    assert len(rows) == module.CUDA_ROWS and all(r in design for r in rows)
    assert {r["precision"] for r in rows} == {"16-mixed", "bf16-mixed"}
    first_bf16 = next(i for i, r in enumerate(rows) if r["precision"] == "bf16-mixed")
    assert all(r["precision"] == "16-mixed" for r in rows[:first_bf16])
    assert {r["optimizer"] for r in rows if r["precision"] == "16-mixed"} >= {"foreach", "fused"}
    assert rows == module.cuda_rows()  # deterministic


def test_fsdp2_rows_are_one_bf16_row_per_checkpoint_form():
    module = _module()
    rows = module.fsdp2_rows()
    matrix = sys.modules["invariant_matrix"]
    assert [r["strategy"] for r in rows] == ["fsdp2", "fsdp2_whole"]
    assert all(r in matrix.fsdp2_design() and r["precision"] == "bf16-mixed" for r in rows)
    assert not any(matrix.expected_refusal(r) for r in rows)
