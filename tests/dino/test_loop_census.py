"""The loop census (``loop_census.py``): real ``ssl-xcit fit`` steps of the quickstart recipe, as a user runs
them (its progress bar, loggers, the online k-NN monitor at the epoch's end, checkpoints), with accumulation 2.
Over whole iterations of Lightning's epoch loop (one batch's fetch to the next, hooks included), no host read
outside the iterations that read on purpose: every ``sync_every_n_steps`` (= ``log_every_n_steps`` here)
micro-batches, and the epoch's end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import torchrun
from loop_census import summary
from PIL import Image

WORKER = Path(__file__).with_name("census_worker.py")
WARMUP = 2  # the first iterations: optimiser state, the first schedules and groups are made there
STEPS = 8  # micro-batches per rank: 4 optimiser steps, 2 sync windows of 4

# Sites whose fix belongs to another branch of issue 35 (regular expressions on the site); remove an entry once
# that branch is merged.
PENDING = {
    r"ssl_xcit/dino/syncbn\.py": "AllReduceBatchNorm's torch.tensor(..., device=) (the cluster branch)",
    r"ssl_xcit/dino/step_checks\.py:\d+ \(any\)": "HostAgreement's all-reduce and read per step (the cluster branch)",
}


def images(root: Path, per_class: int) -> Path:
    """2 labelled classes of small JPEGs (train) and 3 each (val), ImageFolder layout."""
    rng = np.random.default_rng(0)
    for split, n in (("train", per_class), ("val", 3)):
        for c in range(2):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (24, 24, 3), dtype=np.uint8) // 2 + 60 * c
                Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{i}.jpg")
    return root


def unplanned(windows: list[dict]) -> list[dict]:
    """The steady-state iterations (after the warm-up, no periodic read marked) that read the host, with the
    findings whose fix is pending elsewhere left out."""
    bad = []
    for w in windows:
        if w["batch_idx"] < WARMUP or w["marks"]:
            continue
        found = [f for f in w["found"] if not any(re.search(key, f[1]) for key in PENDING)]
        if found:
            bad.append({**w, "found": found})
    return bad


def check(windows: list[dict], label: str) -> None:
    assert len(windows) == STEPS, [(w["epoch"], w["batch_idx"]) for w in windows]
    steady = [w for w in windows if w["batch_idx"] >= WARMUP and not w["marks"]]
    marked = [w for w in windows if "sync" in w["marks"]]
    assert len(steady) >= STEPS // 2 and len(marked) == STEPS // 4, [w["marks"] for w in windows]
    bad = unplanned(windows)
    where = ", ".join(f"{w['epoch']}/{w['batch_idx']}" for w in bad)
    assert not bad, (
        f"{label}: host reads in {len(bad)} steady-state iterations (epoch/batch {where}):\n{summary(bad)}\n"
        f"every site of the run:\n{summary(windows)}"
    )


def test_quickstart_loop_reads_nothing_between_syncs(tmp_path):
    """One process, in this one (~10 s): the progress bar, logging, accumulation, the k-NN monitor."""
    import census_worker

    data = images(tmp_path / "images", per_class=16)
    windows = census_worker.main(tmp_path, data, 1, STEPS)
    check(windows, "1 process")


@pytest.mark.slow
@pytest.mark.distributed
def test_quickstart_loop_reads_nothing_between_syncs_under_ddp(tmp_path):
    """2 gloo processes: adds Lightning's SIGTERM broadcast, DDP's gradient reduction and synced BatchNorm."""
    data = images(tmp_path / "images", per_class=32)
    torchrun(WORKER, str(tmp_path), str(data), "2", str(STEPS), timeout=240)
    for rank in range(2):
        windows = json.loads((tmp_path / f"rank{rank}.json").read_text())
        check(windows, f"rank {rank} of 2")
