"""benchmarks/bench_throughput.py: the CI-size run measures both modes, the limit, workers needed and FLOPs."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_throughput.py"


def test_ci_run_on_the_device_path_prints_the_limit_and_ratios(capsys):
    spec = importlib.util.spec_from_file_location("bench_throughput", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--ci", "--augment-on", "device", "--peak-tflops", "1"])
    out = capsys.readouterr().out
    assert all(result[k] > 0 for k in ("ceiling", "loader", "through_loader", "flops_per_image"))
    assert "augment_on=device" in out and "bf16 autocast off, fused AdamW off, torch.compile off" in out
    assert f"ratio (b) / (a): {result['through_loader'] / result['ceiling']:.2f}" in out
    needed = math.ceil(result["ceiling"] / result["per_worker"])
    assert f"workers per device to reach the ceiling: {needed}" in out
    assert f"MFU {100 * result['ceiling'] * result['flops_per_image'] / 1e12:.1f} %" in out
