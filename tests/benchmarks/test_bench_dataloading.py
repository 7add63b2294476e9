"""benchmarks/bench_dataloading.py: the CI-size run times both loading paths side by side and prints ratios."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_dataloading.py"


def test_ci_run_prints_both_paths_and_their_ratio(capsys):
    spec = importlib.util.spec_from_file_location("bench_dataloading", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--ci", "--compare-augment"])
    out = capsys.readouterr().out
    assert len(rows) == 1
    label, old, new = rows[0]
    assert label.startswith("ci 2x64 + 2x32") and old > 0 and new > 0
    assert f"ratio new / current = {new / old:.2f}x" in out
    assert "current (PIL, all augmentation)" in out and "new CPU half (uint8 crops)" in out
    assert "device half on CPU, ours (batched, per-sample params)" in out
    assert "ratio ours / torchvision v2, loop per sample" in out
