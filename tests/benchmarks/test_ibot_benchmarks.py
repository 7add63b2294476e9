"""benchmarks/bench_masking.py and benchmarks/near_duplicates.py at tiny sizes: real numbers, real files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
from PIL import Image

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_masking_prints_times_and_ratios(capsys):
    results = _load("bench_masking").main(["--batch", "4", "--repeats", "2"])
    out = capsys.readouterr().out
    assert all(v > 0 for v in results.values())
    ratio = results["masks p16"] / results["crops"]
    assert f"{results['masks p16']:8.2f} {ratio:8.3f}" in out and "14x14 grid" in out and "28x28 grid" in out


def test_near_duplicate_queries_are_transformed_copies(tmp_path):
    bench = _load("near_duplicates")
    rng = np.random.default_rng(0)
    source = Image.fromarray(rng.integers(0, 256, (120, 160, 3), dtype=np.uint8))
    copy, quality, record = bench.transformed_copy(source, rng)
    left, top, w, h = record["crop"]
    assert copy.size == (w, h) and 0.4 * 160 * 120 * 0.9 <= w * h <= 0.8 * 160 * 120 * 1.1
    assert 8 <= abs(record["angle"]) <= 30 and 20 <= quality <= 50
    assert all(0.6 <= f <= 1.4 for f in record["colour"]) and abs(record["hue"]) <= 0.05
    # Not a plain crop: rotation and colour changed the pixels.
    assert (
        np.abs(
            np.asarray(copy, float) - np.asarray(source.crop((left, top, left + w, top + h)), float)
        ).mean()
        > 5
    )


def test_near_duplicate_benchmark_is_a_retrieval_json(tmp_path, shared_data):
    from ssl_xcit.retrieval.benchmarks import load_json_benchmark

    path = _load("near_duplicates").build("flowers5", tmp_path, n_queries=3, seed=0, limit=10)
    spec = json.loads(path.read_text())
    assert len(spec["database"]) == 10 and len(spec["queries"]) == 3
    assert [len(p) for p in spec["positives"]] == [1, 1, 1]
    dataset = load_json_benchmark(path)
    assert len(dataset.database) == 10 and len(dataset.queries) == 3
    # The training split (for PCA and codebooks) never contains a benchmark photo.
    train = set((tmp_path / "train_images.txt").read_text().split())
    assert train and not train & set(spec["database"])


def test_hard_preset_queries_are_partial_rescaled_views():
    bench = _load("near_duplicates")
    rng = np.random.default_rng(3)
    source = Image.fromarray(np.random.default_rng(0).integers(0, 256, (120, 160, 3), dtype=np.uint8))
    grays = 0
    for _ in range(40):
        copy, quality, record = bench.hard_copy(source, rng)
        left, top, w, h = record["crop"]
        assert 0.35 * 160 - 1 <= w <= 0.65 * 160 + 1 and 0.35 * 120 - 1 <= h <= 0.65 * 120 + 1
        assert 0 <= left <= 160 - w and 0 <= top <= 120 - h
        assert copy.size == (round(w * record["scale"]), round(h * record["scale"]))
        assert 0.5 <= record["scale"] <= 1.5 and abs(record["angle"]) <= 20 and 40 <= quality <= 75
        pixels = np.asarray(copy, dtype=int)
        is_gray = bool((pixels[..., 0] == pixels[..., 1]).all() and (pixels[..., 1] == pixels[..., 2]).all())
        assert is_gray == record["grayscale"]
        grays += is_gray
    assert 2 <= grays <= 16  # one in five of 40


def test_hard_benchmark_with_every_source_photo_held_out(tmp_path, shared_data):
    from ssl_xcit.retrieval.benchmarks import load_json_benchmark

    bench = _load("near_duplicates")
    train = str(shared_data / "retrieval_mini" / "ukbench")
    path = bench.build("flowers5", tmp_path, n_queries=2, seed=0, limit=6, preset="hard", held_out_all=True,
                       train_images=train)  # fmt: skip
    spec = json.loads(path.read_text())
    assert spec["preset"] == "hard" and len(spec["database"]) == 6 and len(spec["queries"]) == 2
    assert all("scale" in r and "grayscale" in r for r in spec["transforms"])
    assert len((tmp_path / "train_images.txt").read_text().split()) == 10  # the 10 UKBench photos
    assert len(load_json_benchmark(path).queries) == 2
