"""gpu_check's memory section (``benchmarks/gpu_check_memory.py``) on the CPU: its FSDP2 row plans and measures
the sharded configuration, and reports the trace with CPU autocast's lists beside CUDA's."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FSDP2_ROW = "dino_vit_s16, ViT-B/16, fsdp2"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # gpu_check's dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("dry", "ranks"), [(True, 2), (False, 8)])
def test_the_fsdp2_row_plans_vit_b_sharded(dry, ranks):
    memory = _module("gpu_check_memory")
    recipe, overrides, n = memory.CONFIGS[FSDP2_ROW]
    plan = memory.plan_of(recipe, overrides, n, dry)
    assert (plan.strategy, plan.world_size, plan.precision) == ("fsdp2", ranks, "bf16-mixed")
    assert plan.model_args["backbone"] == "vit_base_patch16_224" and plan.autocast == "cuda"
    assert plan.batch_size == (2 if dry else 64)


@pytest.mark.slow  # ~15 s: a trace and a measured step of the 1-block ViT-B/16, twice traced
def test_the_fsdp2_rows_dry_run_matches_the_cpu_measurement(tmp_path):
    gpu_check = _module("gpu_check")
    memory = _module("gpu_check_memory")
    (row,) = [p for p in memory.planned(gpu_check.Check(True, tmp_path)) if p.name == f"memory {FSDP2_ROW}"]
    made = row.make()
    assert made.status == "pass" and "fsdp2 over 2" in made.setting, made
    match = re.search(
        r"plan / measured (\d\.\d+); CPU autocast's lists (\d+\.\d+) GB, (\d\.\d+)\)", made.result
    )
    assert match and abs(float(match.group(1)) - 1) <= memory.TOLERANCE, made.result
