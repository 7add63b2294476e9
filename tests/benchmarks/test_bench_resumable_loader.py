"""benchmarks/bench_resumable_loader.py runs: both loaders deliver the same batches' shapes and it prints one
row per worker count with the ratio (a smoke run on items that cost nothing; the timings are not tested)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_resumable_loader.py"


def test_the_table_has_a_row_per_worker_count(capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_resumable_loader", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    loaders = bench._loaders(bench._Trivial(), 4, 0)
    batches = [next(iter(loader)) for loader in loaders.values()]
    assert [b[2].shape for b in batches] == [(4,), (4,)]
    monkeypatch.setattr(sys, "argv", ["bench", "--workers", "0", "--batches", "2", "--repeats", "1"])
    monkeypatch.setattr(bench, "_dataset", lambda root: bench._Trivial())
    bench.main()
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("0 ")]
    assert len(rows) == 2 and all(float(row[3]) > 0 for row in rows)  # ratio column
