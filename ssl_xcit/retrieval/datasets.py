"""Retrieval benchmarks (Revisited Oxford/Paris, INRIA Holidays, UKBench, a generic JSON format): the loader.

The parsers live in :mod:`.ground_truth` (the record and revisitop) and :mod:`.benchmarks` (the others); image
loading in :mod:`.images`. This module dispatches on the benchmark name and keeps the old import path.
"""

from __future__ import annotations

from pathlib import Path

from ssl_xcit.errors import UserError
from ssl_xcit.retrieval.benchmarks import (
    load_holidays,
    load_json_benchmark,
    load_rotations,
    load_ukbench,
)
from ssl_xcit.retrieval.ground_truth import (
    RetrievalDataset,
    check_files_exist,
    load_revisited,
    load_revisited_gnd,
)
from ssl_xcit.retrieval.images import ImageList, list_images, load_resized, target_size, to_tensor

DATASETS = ("roxford5k", "rparis6k", "holidays", "ukbench", "json")

__all__ = [
    "DATASETS",
    "ImageList",
    "RetrievalDataset",
    "check_files_exist",
    "list_images",
    "load_dataset",
    "load_holidays",
    "load_json_benchmark",
    "load_resized",
    "load_revisited",
    "load_revisited_gnd",
    "load_rotations",
    "load_ukbench",
    "target_size",
    "to_tensor",
]


def load_dataset(
    name: str,
    root: str | Path,
    crop_queries: bool = True,
    gnd_path: str | Path | None = None,
    rotations: str | Path | None = None,
) -> RetrievalDataset:
    """Dispatch on the benchmark name (``roxford5k``, ``rparis6k``, ``holidays``, ``ukbench`` or ``json``)."""
    if name in ("roxford5k", "rparis6k"):
        return load_revisited(name, root, gnd_path=gnd_path, crop_queries=crop_queries)
    if name == "holidays":
        return load_holidays(root, rotations=rotations)
    if name == "ukbench":
        return load_ukbench(root)
    if name == "json":
        return load_json_benchmark(root)
    raise UserError(f"unknown retrieval dataset {name!r}; valid: {', '.join(DATASETS)}")
