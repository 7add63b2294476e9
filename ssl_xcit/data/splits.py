"""Deterministic stratified train/val splits (flowers5's fixed split for the DINO benchmark and evaluations)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

from ssl_xcit.errors import UserError

S = TypeVar("S", bound=tuple)


def stratified_split(samples: Sequence[S], val_fraction: float, seed: int = 0) -> tuple[list[S], list[S]]:
    """Split ``(path, label, ...)`` samples into ``(train, val)`` with ``val_fraction`` of every class in val.

    Stable across machines and listing orders: samples are sorted by path (as a POSIX string), and each class
    is shuffled by its own ``numpy.random.default_rng([seed, label])`` (PCG64, a fixed algorithm), so adding a
    class never changes another class's split. Each class of at least 2 samples keeps one sample on each side;
    a class of one sample stays in train. Both outputs are sorted by path.

    Not ``sklearn.model_selection.train_test_split(stratify=...)``: it draws one permutation over all classes
    (adding a class reshuffles every other class) and refuses a class of one sample.
    """
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    by_class: dict[int, list[S]] = defaultdict(list)
    for sample in sorted(samples, key=lambda s: Path(s[0]).as_posix()):
        by_class[int(sample[1])].append(sample)
    train: list[S] = []
    val: list[S] = []
    for label in sorted(by_class):
        members = by_class[label]
        n = len(members)
        n_val = min(max(round(n * val_fraction), 1), n - 1) if n >= 2 else 0
        order = np.random.default_rng([seed, label + 1]).permutation(n)  # +1: default_rng rejects -1
        val += [members[i] for i in order[:n_val]]
        train += [members[i] for i in order[n_val:]]
    key = lambda s: Path(s[0]).as_posix()  # noqa: E731
    return sorted(train, key=key), sorted(val, key=key)
