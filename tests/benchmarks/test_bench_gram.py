"""benchmarks/bench_gram.py at a tiny size: both forms of the Gram term give one loss, and the chunked form's
chunks follow the budget."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gram.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_gram", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plain_and_chunked_forms_measure_the_same_loss():
    bench = _load()
    plain = bench.measure("plain", batch=5, tokens=16, dim=8)
    chunked = bench.measure("chunked", batch=5, tokens=16, dim=8, chunk_bytes=2 * 16 * 16 * 4)
    assert (plain["images_per_chunk"], chunked["images_per_chunk"]) == (5, 2)
    assert abs(plain["loss"] - chunked["loss"]) < 1e-6 and plain["loss"] > 0
    assert plain["peak_mb"] >= 0 and chunked["seconds"] > 0
