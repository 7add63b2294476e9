"""``benchmarks/bench_activation_checkpointing.py`` at a tiny size: both settings run in their own processes and
checkpointing keeps less for the backward (the exact measure) at a higher CPU cost."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_activation_checkpointing.py"


@pytest.mark.slow
def test_checkpointing_keeps_less_for_the_backward():
    spec = importlib.util.spec_from_file_location("bench_ac", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--models", "vit_tiny_patch16_224", "--backbone-kwargs", '{"depth": 4}', "--batch-size", "2",
            "--global-size", "64", "--local-size", "32", "--local-crops", "2", "--out-dim", "64", "--steps", "1"]  # fmt: skip
    (row,) = bench.main(args)
    assert row["saved_mib_ac"] < 0.6 * row["saved_mib"]  # 4 blocks: only their inputs are kept
    assert row["step_s"] > 0 and row["step_s_ac"] > 0
