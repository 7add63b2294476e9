from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ssl_xcit.retrieval import RetrievalDataset, load_ukbench
from ssl_xcit.visualize.common import VisualizeError
from ssl_xcit.visualize.retrieval import load_results, marks, retrieval_figure


def _revisited(paths):
    gnd = [{"easy": np.array([0, 1]), "hard": np.array([2]), "junk": np.array([3])}]
    return RetrievalDataset("toy", "revisited", list(paths), [paths[0]], gnd)


def test_revisited_marks_follow_each_setup():
    ds = _revisited([Path(f"{i}.jpg") for i in range(6)])
    ranked = [2, 0, 3, 5, 1, 4]
    assert marks(ds, 0, ranked, "easy") == ["junk", "positive", "junk", "negative", "positive", "negative"]
    assert marks(ds, 0, ranked, "medium") == [
        "positive",
        "positive",
        "junk",
        "negative",
        "positive",
        "negative",
    ]
    assert marks(ds, 0, ranked, "hard") == ["positive", "junk", "junk", "negative", "junk", "negative"]
    with pytest.raises(VisualizeError, match="'extreme'"):
        marks(ds, 0, ranked, "extreme")


def test_grid_marks_equal_the_ukbench_ground_truth(shared_data, tmp_path):
    root = shared_data / "retrieval_mini" / "ukbench"
    ds = load_ukbench(root)
    n = len(ds.database)
    ranks = [np.roll(np.arange(n), -q).tolist() for q in range(n)]  # query q first, then q+1, q+2, ...
    results = tmp_path / "run.json"
    results.write_text(
        json.dumps({"config": {"dataset": "ukbench", "data_root": str(root)}, "top_ranks": ranks})
    )
    loaded, loaded_ranks, _ = load_results(results)
    fig, drawn = retrieval_figure(loaded, loaded_ranks, [0, 5], top=6, size=32)
    groups = np.asarray(ds.groups)
    for row, q in enumerate([0, 5]):
        expected = [
            "junk" if i == q else "positive" if groups[i] == groups[q] else "negative" for i in ranks[q][:6]
        ]
        assert drawn[row] == expected
        titles = [ax.get_title() for ax in fig.axes[row * 7 + 1 : row * 7 + 7]]
        assert titles == [f"{c}: {m}" for c, m in enumerate(expected, start=1)]
    with pytest.raises(VisualizeError, match="out of range"):
        retrieval_figure(loaded, loaded_ranks, [n + 3])


def test_results_file_errors_name_the_file(tmp_path):
    with pytest.raises(VisualizeError, match="nope.json"):
        load_results(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(VisualizeError, match="bad.json is not a results JSON"):
        load_results(bad)


def test_revisited_titles_show_every_setup(shared_data):
    photos = sorted((shared_data / "flowers5" / "daisy").glob("*.jpg"))[:6]
    ds = _revisited(photos)
    fig, drawn = retrieval_figure(ds, [[2, 0, 3, 5]], top=4, size=32)
    assert drawn == [["positive", "positive", "junk", "negative"]]  # medium by default
    titles = [ax.get_title() for ax in fig.axes[1:]]
    assert titles == ["1: Ej M+ H+", "2: E+ M+ Hj", "3: Ej Mj Hj", "4: E- M- H-"]


def test_command_reuses_the_retrieval_descriptor_cache(shared_data, tmp_path, monkeypatch):
    from ssl_xcit.cli import main
    from ssl_xcit.retrieval import stages  # where run_retrieval calls extract_global

    argv = [
        "visualize",
        "retrieval",
        "--arch",
        "xcit_nano_12_p16",
        "--dataset",
        "ukbench",
        "--data-root",
        str(shared_data / "retrieval_mini" / "ukbench"),
        "--resolution",
        "64",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--out",
        str(tmp_path),
        "--no-progress",
        "--top",
        "4",
    ]
    png = main(argv)
    assert list((tmp_path / "cache").rglob("*")), "the first run stores descriptors"

    def no_extraction(*args, **kwargs):
        raise AssertionError("descriptors were extracted again instead of read from the cache")

    monkeypatch.setattr(stages, "extract_global", no_extraction)
    png.unlink()
    assert main(argv).is_file()
