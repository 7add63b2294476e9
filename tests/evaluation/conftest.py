"""Fixtures for the evaluation tests: a small deterministic ImageFolder split of flowers5 (real photos)."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest

from .helpers import TRAIN_PER_CLASS, VAL_PER_CLASS


def _link_tree(root: Path, samples: list[tuple[Path, int]], classes: list[str], per_class: int) -> None:
    count: dict[int, int] = defaultdict(int)
    for path, label in samples:
        if count[label] == per_class:
            continue
        count[label] += 1
        target = root / classes[label] / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(path, target)


@pytest.fixture(scope="session")
def flowers_split(shared_data: Path, tmp_path_factory) -> tuple[Path, Path]:
    """``(train_dir, val_dir)``: 60 + 20 images per class from flowers5's stratified split (seed 0), symlinked."""
    from ssl_xcit.data.datasets import build_dataset
    from ssl_xcit.data.splits import stratified_split

    full = build_dataset(shared_data / "flowers5")
    train, val = stratified_split(full.samples, val_fraction=0.2, seed=0)
    root = tmp_path_factory.mktemp("flowers_split")
    _link_tree(root / "train", train, full.classes, TRAIN_PER_CLASS)
    _link_tree(root / "val", val, full.classes, VAL_PER_CLASS)
    return root / "train", root / "val"


@pytest.fixture(scope="session")
def knn_run(flowers_split, tmp_path_factory):
    """One end-to-end ``ssl-xcit knn`` run (random-init nano, torch backend), shared by several tests."""
    from ssl_xcit.cli import main

    from .helpers import small_args

    train, val = flowers_split
    out = tmp_path_factory.mktemp("knn_run")
    cache = out / "cache"
    results = main(["knn", *small_args(train, val, cache), "--output", str(out / "knn.json")])
    return results, out


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]
