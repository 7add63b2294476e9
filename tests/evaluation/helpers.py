"""Constants and option lists shared by the evaluation tests."""

from __future__ import annotations

from pathlib import Path

# Tiny backbone at a tiny resolution keeps every extraction to seconds on 2 CPU cores.
ARCH = "xcit_nano_12_p16"
RESIZE, CROP = 73, 64  # 64 / 73 ~ DINO's 224 / 256
TRAIN_PER_CLASS, VAL_PER_CLASS = 60, 20


def small_args(train: Path, val: Path, cache_dir: Path) -> list[str]:
    """CLI options shared by the end-to-end tests."""
    return [
        "--train",
        str(train),
        "--val",
        str(val),
        "--arch",
        ARCH,
        "--resize-size",
        str(RESIZE),
        "--crop-size",
        str(CROP),
        "--batch-size",
        "64",
        "--num-workers",
        "0",
        "--accelerator",
        "cpu",
        "--devices",
        "1",
        "--cache-dir",
        str(cache_dir),
        "--no-progress",
    ]
