"""2-process Lightning DDP on CPU (gloo) agrees with one process on the same global batch."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("ddp_worker.py")


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


def _load_worker():
    spec = importlib.util.spec_from_file_location("ddp_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    return worker


def _mode_runs(tmp_path, ddp_runs, mode: str):
    """(worker module, the single-process run, the two ranks, the source file's tensors) of a worker mode."""
    worker = _load_worker()
    single = worker.run(tmp_path, 1, **worker.MODES[mode])
    ranks = _ranks(ddp_runs, mode)
    assert [r["global_step"] for r in ranks] == [2, 2]
    return worker, single, ranks, torch.load(worker.source_file(tmp_path), weights_only=True)["state_dict"]


def _students_agree(ranks, single) -> None:
    """Both ranks' students are identical, and equal the single-process student on the same global batch."""
    for key, value in ranks[0]["student"].items():
        torch.testing.assert_close(ranks[1]["student"][key], value, rtol=0, atol=0)
        torch.testing.assert_close(value, single["student"][key], rtol=1e-4, atol=1e-6)


@pytest.mark.distributed
def test_ddp_distillation_matches_single_process_with_the_teacher_frozen(tmp_path, ddp_runs):
    """A distillation run under DDP: the students of both ranks equal the single-process student on the same
    global batch, and the frozen teacher is bit-identical to the file it came from on both ranks."""
    _, single, ranks, source = _mode_runs(tmp_path, ddp_runs, "distill")
    for r in ranks:
        for key, value in source.items():
            assert torch.equal(r["teacher"][f"backbone.{key}"], value), key
    _students_agree(ranks, single)
    for step in range(2):
        mean = (ranks[0]["losses"][step] + ranks[1]["losses"][step]) / 2
        assert mean == pytest.approx(single["losses"][step], rel=1e-5)


@pytest.mark.distributed
def test_ddp_init_from_starts_both_ranks_from_the_source_and_warms_the_head_alone(tmp_path, ddp_runs):
    """init_from under DDP: both ranks load the file; during the head warm-up the backbones stay exactly the
    source's (DDP must not move parameters that get no gradient) while the heads train, equally on both."""
    worker, single, ranks, source = _mode_runs(tmp_path, ddp_runs, "init_from")
    for r in ranks:
        for key, value in source.items():
            assert torch.equal(r["student"][f"backbone.{key}"], value), key
            # The EMA still runs: m * x + (1 - m) * x is x up to float rounding.
            torch.testing.assert_close(r["teacher"][f"backbone.{key}"], value, rtol=1e-6, atol=1e-9)
    head = [k for k in ranks[0]["student"] if k.startswith("head.") and k.endswith("weight")]
    initial = worker.build_init_from(worker.source_file(tmp_path)).student.state_dict()
    assert any(not torch.equal(ranks[0]["student"][k], initial[k]) for k in head)  # the head did train
    _students_agree(ranks, single)


@pytest.mark.distributed
def test_ddp_rankme_every_rank_logs_the_value_of_all_held_out_images(ddp_runs):
    """RankMe under DDP: each rank embeds a share of the held-out images (one image unreadable, and in the
    second monitor rank 1's only image), the Gram matrices are summed, and both ranks hold the RankMe of all
    readable images, as numpy computes it from the teacher's embeddings, at step 0 and at the end."""
    # By path: tests/ has no packages, and the module is importable by name only when tests/trainer is collected.
    spec = importlib.util.spec_from_file_location(
        "rankme_reference", Path(__file__).resolve().parents[1] / "trainer" / "test_rankme.py"
    )
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    numpy_rankme = reference.numpy_rankme

    worker = _load_worker()
    ranks = _ranks(ddp_runs, "rankme")
    assert ranks[0]["rankme"] == ranks[1]["rankme"]
    teacher = worker.build().teacher
    for monitor, images in zip(ranks[0]["rankme"], ([0, 1, 2, 3, 5, 6], [0, 2]), strict=True):
        assert [h["step"] for h in monitor] == [0, 2]
        batch = torch.stack([worker.held_out_image(i) for i in images])
        for entry, state in (
            (monitor[0], worker.build().teacher.state_dict()),
            (monitor[1], ranks[0]["teacher"]),
        ):
            teacher.load_state_dict(state)
            with torch.no_grad():
                cls, patches = teacher.backbone.eval().forward_cls_patches(batch)
            assert entry["embedding"] == pytest.approx(numpy_rankme(cls.double().numpy()), rel=1e-4)
            flat = patches.reshape(-1, patches.shape[-1]).double().numpy()
            assert entry["patch"] == pytest.approx(numpy_rankme(flat), rel=1e-4)


@pytest.mark.distributed
def test_ddp_high_res_stage_switches_on_every_rank_at_the_same_step(ddp_runs):
    """The high-resolution last epoch under DDP: the stage follows the epoch, so both ranks crop 16/8 px in
    epoch 0 and 32/16 px in epoch 1, step for step."""
    ranks = [torch.load(ddp_runs / "high_res" / f"rank{r}_of2.pt", weights_only=True) for r in range(2)]
    assert ranks[0]["sizes"] == ranks[1]["sizes"] == [(0, 16, 8), (1, 16, 8), (2, 32, 16), (3, 32, 16)]
    assert [r["global_step"] for r in ranks] == [4, 4]


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["plain", "distill", "init_from"])
def test_fsdp2_equals_ddp_over_the_same_steps(ddp_runs, mode):
    """``--trainer.strategy fsdp2`` (per-block fully_shard, sharded EMA, clipping on sharded gradients) gives
    DDP's losses, centres, student and teacher after 2 steps on 2 gloo processes, within float32 reduction
    order: the quickstart's DINO (plain), a distillation run (frozen ViT teacher, sharded too) and a run
    started from a file (whole tensors loaded into the shards)."""
    worker = _load_worker()
    initial = (
        worker.initial_student()
        if mode != "init_from"
        else worker.build_init_from(worker.source_file(ddp_runs)).student.state_dict()
    )
    for ddp, fsdp in zip(_ranks(ddp_runs, mode), _ranks(ddp_runs, f"fsdp2-{mode}"), strict=True):
        assert fsdp["sharded"] == ["DTensor"] and ddp["sharded"] == ["Parameter"]
        assert fsdp["global_step"] == ddp["global_step"] == 2
        assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-6)
        torch.testing.assert_close(fsdp["centers"], ddp["centers"], rtol=1e-5, atol=1e-7)
        for network in ("student", "teacher"):
            assert fsdp[network].keys() == ddp[network].keys()
            for key, value in ddp[network].items():
                torch.testing.assert_close(fsdp[network][key], value, rtol=1e-5, atol=1e-7, msg=key)
    moved = [k for k, v in ddp["student"].items() if k in initial and not torch.equal(v, initial[k])]
    assert len(moved) > (5 if mode == "init_from" else 10)  # training moved what the comparison covers
