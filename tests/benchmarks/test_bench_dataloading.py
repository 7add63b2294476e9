"""benchmarks/bench_dataloading.py: the CI-size run times both loading paths side by side and prints ratios."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_dataloading.py"


def test_ci_run_prints_the_four_paths_and_their_ratios(capsys):
    spec = importlib.util.spec_from_file_location("bench_dataloading", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--ci", "--compare-augment"])
    out = capsys.readouterr().out
    assert len(rows) == 1
    label, *rates = rows[0]
    assert label.startswith("ci 2x64 + 2x32") and len(rates) == 4 and min(rates) > 0
    for path, rate in zip(bench.PATHS, rates, strict=True):
        assert f"{path:38s} {rate:7.1f} images/s per worker, x{rate / rates[0]:.2f} the CPU path" in out
    assert "device half on this CPU (1 thread), decode_on=worker" in out
    assert "device half on this CPU (1 thread), decode_on=device" in out
    assert "device half on CPU, ours (batched, per-sample params)" in out
    assert "ratio ours / torchvision v2, loop per sample" in out
