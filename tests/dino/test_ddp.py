"""2-process Lightning DDP on CPU (gloo) agrees with one process on the same global batch."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from conftest import torchrun

WORKER = Path(__file__).with_name("ddp_worker.py")


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> Path:
    """The three 2-process runs below, one after another in one launch (each in its own folder): starting
    torchrun and importing torch and Lightning in both ranks took most of each test's ~17 s. A rank left
    waiting in a collective ends in ``TimeoutExpired``, with the launcher and both workers killed."""
    out = tmp_path_factory.mktemp("ddp")
    torchrun(WORKER, str(out), "2", "plain,empty,ibot", timeout=240)
    return out


def _ranks(out: Path, mode: str) -> list[dict]:
    return [torch.load(out / mode / f"rank{r}_of2.pt", weights_only=True) for r in range(2)]


@pytest.mark.distributed
def test_ddp_rank_with_unreadable_batch_does_not_hang(ddp_runs):
    """Rank 1's first batch is all unreadable: both ranks skip that step together, then train in step."""
    ranks = _ranks(ddp_runs, "empty")  # a hang would have ended in TimeoutExpired
    assert [r["global_step"] for r in ranks] == [1, 1]
    assert [r["skipped_batches"] for r in ranks] == [1, 1]
    for key, value in ranks[0]["student"].items():
        torch.testing.assert_close(ranks[1]["student"][key], value, rtol=0, atol=0)


@pytest.mark.distributed
def test_ddp_with_ibot_trains_in_step_on_both_ranks(ddp_runs):
    """iBOT's patch term under DDP: each rank masks its own crops, Sinkhorn-Knopp all-reduces over the masked
    patches of both; the ranks finish together with identical weights, the mask token trained."""
    ranks = _ranks(ddp_runs, "ibot")
    assert [r["global_step"] for r in ranks] == [2, 2]
    assert all(math.isfinite(loss) for r in ranks for loss in r["losses"])
    for key, value in ranks[0]["student"].items():
        torch.testing.assert_close(ranks[1]["student"][key], value, rtol=0, atol=0)
    assert ranks[0]["student"]["backbone.mask_token"].abs().sum() > 0  # zeros at start


@pytest.mark.distributed
def test_ddp_center_loss_and_weights_match_single_process(tmp_path, ddp_runs):
    spec = importlib.util.spec_from_file_location("ddp_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    single = worker.run(tmp_path, 1)
    initial = worker.initial_student()

    ranks = _ranks(ddp_runs, "plain")
    assert all(r["world_size"] == 2 for r in ranks)
    assert "AllReduceBatchNorm" in ranks[0]["bn_types"]  # XCiT's BatchNorms were synchronised
    # The centre is all-reduced: identical on both ranks and equal to the single-process centre.
    torch.testing.assert_close(ranks[0]["centers"], ranks[1]["centers"], rtol=0, atol=0)
    torch.testing.assert_close(ranks[0]["centers"], single["centers"], rtol=1e-4, atol=1e-6)
    # Each rank's loss is over its half batch; their mean is the global-batch loss.
    for step in range(len(single["losses"])):
        mean = (ranks[0]["losses"][step] + ranks[1]["losses"][step]) / 2
        assert mean == pytest.approx(single["losses"][step], rel=1e-5)
    assert ranks[0]["losses"][0] != pytest.approx(ranks[1]["losses"][0], rel=1e-6)  # really different halves
    # After 2 optimiser steps the student weights agree (DDP gradient averaging + synced BN).
    for key, value in single["student"].items():
        torch.testing.assert_close(ranks[0]["student"][key], value, rtol=1e-4, atol=1e-6)
    moved = [
        k for k, v in single["student"].items() if k.endswith("weight") and not torch.equal(v, initial[k])
    ]
    assert len(moved) > 10  # the comparison is not vacuous: training changed the weights
