"""Ranks decide together (issue 19): a difference on one rank never leaves another waiting in a collective.

Each test is a real 2-process Lightning DDP run on CPU (gloo) under a timeout, where only rank 1 sees the
difference; ``agreement_worker.py`` describes the scenarios.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from conftest import torchrun

WORKER = Path(__file__).with_name("agreement_worker.py")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, list[dict]]:
    """What each rank saw, per scenario. The scenarios run one after another in one 2-process launch:
    starting torchrun and importing torch and Lightning in both ranks took most of each test's ~18 s."""
    out = tmp_path_factory.mktemp("agreement")
    scenarios = ("collapse", "validation", "koleo", "knn", "loss_scale")
    torchrun(WORKER, str(out), "2", ",".join(scenarios), timeout=240)
    return {
        s: [torch.load(out / f"{s}_rank{r}_of2.pt", weights_only=False) for r in range(2)] for s in scenarios
    }


def _single(tmp_path: Path, scenario: str) -> dict:
    """The same scenario in this process, world size 1."""
    import sys

    sys.path.insert(0, str(WORKER.parent))
    try:
        spec = importlib.util.spec_from_file_location("agreement_worker", WORKER)
        worker = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(worker)
        return worker.run(tmp_path, 1, scenario)
    finally:
        sys.path.remove(str(WORKER.parent))


@pytest.mark.distributed
def test_collapse_on_rank_1_stops_both_ranks_on_the_same_step_and_is_reported(two_ranks):
    ranks = two_ranks["collapse"]
    assert [r["global_step"] for r in ranks] == [2, 2]  # patience 2: both stop after step 2
    for r in ranks:
        assert [(e["mode"], e["step"], e["ranks"]) for e in r["events"]] == [("uniform", 2, [1])]
    # Reported by rank 0 (rank_zero_warn), with rank 1's numbers.
    assert len(ranks[0]["warnings"]) == 1
    assert (
        "collapse (uniform) for 2 steps at step 2 on rank 1: teacher entropy 3.466" in ranks[0]["warnings"][0]
    )
    assert "Training stopped" in ranks[0]["warnings"][0]


@pytest.mark.distributed
def test_validation_batch_unreadable_on_one_rank_is_skipped_by_both(tmp_path, two_ranks):
    ranks = two_ranks["validation"]
    single = _single(tmp_path, "validation")
    assert ranks[0]["val_loss"] == ranks[1]["val_loss"]  # synced
    # Both skipped batch 0; batch 1 is the global batch 8..15, whose Sinkhorn-Knopp loss one process gives.
    assert ranks[0]["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)


@pytest.mark.distributed
def test_koleo_with_one_image_on_a_rank_does_not_stop_the_run(two_ranks):
    ranks = two_ranks["koleo"]
    assert [r["global_step"] for r in ranks] == [2, 2]
    assert ranks[1]["koleo"][0] == 0.0  # one image, no neighbour: no KoLeo term
    assert ranks[0]["koleo"][0] != 0.0 and all(k != 0.0 for r in ranks for k in r["koleo"][1:])
    for key, value in ranks[0]["student"].items():  # DDP kept the replicas identical
        torch.testing.assert_close(ranks[1]["student"][key], value, rtol=0, atol=0)


@pytest.mark.distributed
def test_online_knn_splits_the_work_and_matches_one_process(tmp_path, two_ranks):
    ranks = two_ranks["knn"]
    single = _single(tmp_path, "knn")
    assert len(single["history"]) == 2  # before training and after the epoch
    for r in ranks:
        assert [h["top1"] for h in r["history"]] == [h["top1"] for h in single["history"]]
        assert r["logged_top1"] == single["logged_top1"]
        # Every rank scored on the whole bank (19 readable images, in order), as one process does.
        assert len(r["banks"]) == 2
        for (features, labels), (ref_features, ref_labels) in zip(r["banks"], single["banks"], strict=True):
            assert torch.equal(labels, ref_labels) and len(labels) == 19
            torch.testing.assert_close(features, ref_features, rtol=1e-5, atol=1e-6)
    # The work is split: per evaluation rank 0 embeds bank 0..10 (10 readable) + queries 0..5 (6), rank 1
    # bank 11..20 (9) + queries 6..10 (4), plus one padding batch of 2 rows, so that it makes as many forwards
    # as rank 0 (a sharded teacher all-gathers in each: ssl_xcit.evaluation.embed.lockstep_batches); one
    # process embeds all 19 + 10.
    assert [r["images_embedded"] for r in ranks] == [2 * 16, 2 * (13 + 2)]
    assert single["images_embedded"] == 2 * 29


@pytest.mark.distributed
def test_a_collapsed_loss_scale_on_one_rank_stops_both_at_the_same_step(two_ranks):
    """Rank 1's scale falls below 1 after step 1 (rank 0's stays at 65536 or half of it); the read after step 2
    takes the smallest over the ranks, so both stop there with the same error."""
    ranks = two_ranks["loss_scale"]
    assert [r["global_step"] for r in ranks] == [2, 2]
    assert ranks[0]["error"] == ranks[1]["error"]
    assert re.match(
        r"16-mixed: the GradScaler skipped optimiser steps until its loss scale fell to 0\.(25|125) \(below 1\) "
        r"by global step 2 ",
        ranks[0]["error"],
    )
