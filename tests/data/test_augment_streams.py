"""The device augmentation's draws per batch: different on every rank after a resume, untouched by validation.

A probe module on identical flat-colour images records each batch's augmented colours (``augment_worker.py``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
WORKER = HERE / "augment_worker.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _load("augment_worker", WORKER)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # moved out of the default suite (its 10-minute budget)
@pytest.mark.distributed
def test_ranks_draw_different_augmentations_after_a_resume_and_what_the_full_run_drew(tmp_path):
    torchrun = _load("dino_conftest", HERE.parent / "dino" / "conftest.py").torchrun
    root = worker.make_identical_images(tmp_path / "data")
    torchrun(WORKER, str(root), str(tmp_path), "resume", timeout=240)
    ranks = [torch.load(tmp_path / f"resume_rank{r}.pt", weights_only=False) for r in range(2)]
    for run in ("first", "resumed"):
        for key, colours in ranks[0][run].items():
            # Identical images: only the photometric parameters can tell the ranks' batches apart.
            assert not torch.allclose(colours, ranks[1][run][key]), (run, key)
    for rank in ranks:
        # 16 images: 8 per rank, 4 batches of 2 in epoch 1, after the resume.
        assert sorted(rank["resumed"]) == [(1, 0), (1, 1), (1, 2), (1, 3)]
        assert _equal(rank["resumed"], {k: v for k, v in rank["full"].items() if k[0] == 1})
        assert _equal(rank["first"], {k: v for k, v in rank["full"].items() if k[0] == 0})


def test_validation_leaves_the_training_draws_alone_and_repeats_its_own(tmp_path):
    root = worker.make_identical_images(tmp_path / "data")
    runs = worker.validation(root, tmp_path)
    with_val, without = runs["with_val"], runs["without"]
    assert len(with_val.val_draws) == 3 and len(without.val_draws) == 0  # sanity check + after each epoch
    assert sorted(with_val.train_draws) == [(e, b) for e in range(2) for b in range(6)]  # 12 images / 2
    assert _equal(with_val.train_draws, without.train_draws)
    first = with_val.val_draws[0]
    assert len(first) == 2  # the 4 held-out images in batches of 2
    for later in with_val.val_draws[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, later, strict=True))
    assert not torch.equal(first[0], first[1])  # still random per batch
