"""Mid-epoch resume under ``--trainer.strategy fsdp2`` (sharded checkpoints), ``fsdp2_whole`` (one file) and from a
sharded checkpoint gathered into one file (``ssl-xcit gather-checkpoint``): every image once per epoch, in the
uninterrupted run's order, and the networks at the end equal the uninterrupted run's bit for bit, on both
ranks (``resume_worker.py``, as ``test_resume.py`` does for DDP)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import torchrun
from test_resume import _assert_exactly_once, _check_crash_point

WORKER = Path(__file__).with_name("resume_worker.py")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "strategy,gather",
    [("fsdp2", "0"), ("fsdp2_whole", "0"), ("fsdp2", "1")],
    ids=["sharded", "whole", "gathered"],
)
def test_fsdp2_resumes_mid_epoch_exactly_once(tmp_path, strategy, gather):
    """2 gloo processes, 8 steps an epoch, the checkpoint of step 9 (in epoch 1) resumed after a crash at 11."""
    opts = ["epochs=2", "every=3", "crash=11", f"strategy={strategy}", f"gather={gather}"]
    torchrun(WORKER, str(tmp_path), "2", *opts, timeout=600)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_dir() == (strategy == "fsdp2") and last.exists()
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in ranks:
        _check_crash_point(r, 9)
    _assert_exactly_once(ranks, epochs=2)
    for r in ranks:
        for net in ("student", "teacher"):
            for key, value in r["full"][net].items():
                assert torch.equal(r["resumed"][net][key], value), f"{net}.{key}"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "gram", ["10", "5"], ids=["gram-starts-after-the-checkpoint", "gram-on-in-the-checkpoint"]
)
def test_fsdp2_resumes_gram_anchoring_on_either_side_of_its_start(tmp_path, gram):
    """Sharded checkpoint of step 9 (2 gloo processes): Gram anchoring starting at step 10 (the checkpoint holds
    a Gram teacher not yet taken: the resumed run takes it from its own EMA teacher) or at step 5 (the
    checkpoint holds the Gram teacher of step 5, refreshed after step 8; the resumed run refreshes again
    after step 12). Student, EMA teacher and Gram teacher end bit-identical to the uninterrupted run's."""
    opts = ["epochs=2", "every=3", "crash=11", "strategy=fsdp2", f"gram={gram}", "gram_every=4"]
    torchrun(WORKER, str(tmp_path), "2", *opts, timeout=600)
    assert (tmp_path / "ckpt" / "last.ckpt").is_dir()
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in ranks:
        _check_crash_point(r, 9)
    _assert_exactly_once(ranks, epochs=2)
    for r in ranks:
        assert r["full"]["gram"], "no Gram teacher recorded"
        for net in ("student", "teacher", "gram"):
            for key, value in r["full"][net].items():
                assert torch.equal(r["resumed"][net][key], value), f"{net}.{key}"
        # Compared above too: (initialised, refreshes). The Gram teacher was taken and refreshed after the start.
        initialised, refreshes = r["full"]["gram"]["_extra_state"].tolist()
        assert initialised == 1 and refreshes >= 1
