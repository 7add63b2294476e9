"""benchmarks/bench_shards.py runs end to end at tiny size: both readers deliver batches, the table has a row per
dataset, and the byte counts are the files' (a smoke run; the timings are not tested)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_shards.py"


def test_tiny_run_prints_a_row_per_dataset(tmp_path, shared_data, capsys):
    spec = importlib.util.spec_from_file_location("bench_shards", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ukbench = shared_data / "retrieval_mini" / "ukbench"
    rows = bench.main(["--tiny", "--work", str(tmp_path), "--ukbench", str(ukbench), "--workers", "0"])
    assert [r["name"] for r in rows] == ["ukbench x40", "32px x400"]
    photos = sorted(ukbench.glob("*.jpg"))
    expected = sum(photos[i % len(photos)].stat().st_size for i in range(40)) / 40
    assert abs(rows[0]["bytes"][0] - expected) < 1e-6 and rows[1]["files"][0] == 400
    meta = json.loads((tmp_path / "ukbench_40_shards" / "ssl_xcit_shards.json").read_text())
    assert rows[0]["bytes"][1] == meta["bytes"] / 40 > rows[0]["bytes"][0]  # records plus chunk overhead
    assert all(r["rate"][0] > 0 and r["rate"][1] > 0 for r in rows)
    assert all(r["pairs"][0] == r["pairs"][1] == r["rate"][1] / r["rate"][0] for r in rows)  # one pass each
    out = capsys.readouterr().out
    assert out.count("\n") == 4 and "ukbench x40" in out and "32px x400" in out
