"""Exactly-once mid-epoch resume on an image folder (issue 31).

A run killed after a step checkpoint and resumed with ``ckpt_path`` must finish that epoch in the same order
as an uninterrupted run, every image once, on every rank; in one process without workers its weights after
training equal the uninterrupted run's bit for bit. ``resume_worker.py`` runs the three fits. Before the fix
(a plain shuffled ``DataLoader``) the issue's case (64 images, batch 4, checkpoint every 3 steps) saw 51 of 64
images in one process and repeated 13.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import torchrun

WORKER = Path(__file__).with_name("resume_worker.py")


def _single(tmp_path: Path, **opts) -> dict:
    sys.path.insert(0, str(WORKER.parent))
    try:
        spec = importlib.util.spec_from_file_location("resume_worker", WORKER)
        worker = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(worker)
        return worker.run(tmp_path, 1, {k: str(v) for k, v in opts.items()})
    finally:
        sys.path.remove(str(WORKER.parent))


def _epochs(ranks: list[dict], run: str) -> dict[int, list[int]]:
    """Per epoch, the indices the ranks' batches held, rank 0's first. For ``crashed+resumed``: the crashed
    run's batches up to its last checkpoint, then the resumed run's."""
    out: dict[int, list[int]] = {}
    for r in ranks:
        if run == "crashed+resumed":
            seen = r["crashed"]["seen"][: r["crashed"]["saved"]] + r["resumed"]["seen"]
        else:
            seen = r[run]["seen"]
        for _, epoch, indices in seen:
            out.setdefault(epoch, []).extend(indices)
    return out


def _assert_exactly_once(ranks: list[dict], epochs: int, images: int = 64) -> None:
    resumed, full = _epochs(ranks, "crashed+resumed"), _epochs(ranks, "full")
    assert sorted(resumed) == list(range(epochs))
    for epoch, indices in resumed.items():
        counts = Counter(indices)
        repeated = sorted(i for i, c in counts.items() if c > 1)
        assert not repeated and len(counts) == images, (
            f"epoch {epoch}: saw {len(counts)} of {images} images, {len(repeated)} more than once"
        )
        assert indices == full[epoch]  # the same order (per rank) as the uninterrupted run
    assert all(r["loader_state"] is not None for r in ranks)  # Lightning kept the loader's position


def _assert_same_weights(result: dict) -> None:
    for net in ("student", "teacher"):
        for key, value in result["full"][net].items():
            assert torch.equal(result["resumed"][net][key], value), f"{net}.{key} differs"


def _check_crash_point(result: dict, step: int) -> None:
    assert result["checkpoint_step"] == step
    assert result["crashed"]["global_step"] > step  # the steps after the checkpoint were lost, as in a kill


def test_issue_case_one_process_resumes_mid_epoch_exactly(tmp_path):
    """The issue's case: checkpoint every 3 steps, killed after step 7, resumed from step 6."""
    result = _single(tmp_path, every=3, crash=7)
    _check_crash_point(result, 6)
    _assert_exactly_once([result], epochs=1)
    _assert_same_weights(result)


def test_resume_in_a_later_epoch_with_accumulation_is_exact(tmp_path):
    """Epoch 1 (its order is seeded by the epoch), 3 batches per step: 5 windows of 16 batches, the last
    batch dropped by DINO; the checkpoint after step 7 is mid-window-count of epoch 1 (batch 5)."""
    result = _single(tmp_path, epochs=2, accumulate=3, every=7, crash=8)
    _check_crash_point(result, 7)
    _assert_exactly_once([result], epochs=2)
    _assert_same_weights(result)


def test_resume_with_device_augmentation_is_exact(tmp_path):
    result = _single(tmp_path, epochs=2, every=9, crash=20, augment="device")
    _check_crash_point(result, 18)
    _assert_exactly_once([result], epochs=2)
    _assert_same_weights(result)


@pytest.mark.slow  # moved out of the default suite (its 10-minute budget)
def test_checkpoint_on_an_epochs_last_step_resumes_the_next_epoch(tmp_path):
    """Step 16 is epoch 0's last batch: the epoch-end checkpoint overwrites the step one; epoch 1 whole."""
    result = _single(tmp_path, epochs=2, every=4, crash=17)
    _check_crash_point(result, 16)
    _assert_exactly_once([result], epochs=2)
    _assert_same_weights(result)


@pytest.mark.slow  # moved out of the default suite (its 10-minute budget)
def test_resume_with_workers_sees_every_image_once(tmp_path):
    """With 2 workers the read-ahead batches are not counted as seen. (The workers' random streams restart,
    so the crops, and the weights, differ from the uninterrupted run's.)"""
    result = _single(tmp_path, epochs=2, every=9, crash=20, workers=2)
    _check_crash_point(result, 18)
    _assert_exactly_once([result], epochs=2)


def test_a_checkpoint_without_the_loaders_position_still_resumes(tmp_path):
    """A mid-epoch checkpoint from before this loader (no loader state): the fit goes on from its step to
    the epoch's end, with a new order for the remaining batches (as before), and no error."""
    result = _single(tmp_path, every=3, crash=7, old=1)
    assert result["loader_state"] is not None  # what was written, before it was removed
    seen = result["resumed"]["seen"]
    assert [s for s, _, _ in seen] == list(range(7, 17)) and result["resumed"]["global_step"] == 16
    assert all(len(indices) == 4 for _, _, indices in seen)


def test_dino_checkpoints_adds_the_step_checkpoint_of_the_recipes(tmp_path):
    from ssl_xcit.errors import UserError
    from ssl_xcit.trainer.checkpointing import dino_checkpoints

    for every_n_epochs in (1, 20):
        callbacks = dino_checkpoints(tmp_path, every_n_epochs=every_n_epochs, every_n_train_steps=500)
        assert callbacks[0].filename == "last" and callbacks[0]._every_n_train_steps == 500
        assert all(c._every_n_train_steps == 0 for c in callbacks[1:])
        assert len({c.state_key for c in callbacks}) == len(callbacks)
    assert all(c._every_n_train_steps == 0 for c in dino_checkpoints(tmp_path))
    with pytest.raises(UserError, match="every_n_train_steps must be >= 1 .* got 0"):
        dino_checkpoints(tmp_path, every_n_train_steps=0)


@pytest.mark.slow  # moved out of the default suite (its 10-minute budget)
@pytest.mark.distributed
def test_two_processes_resume_mid_epoch_exactly(tmp_path):
    """2 gloo processes, 4 images each per step (8 steps an epoch); the checkpoint after step 9 is in epoch 1.
    Before the fix the issue saw 40 of 64 images in the resumed epoch."""
    torchrun(WORKER, str(tmp_path), "2", "epochs=2", "every=3", "crash=11", timeout=240)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in ranks:
        _check_crash_point(r, 9)
    _assert_exactly_once(ranks, epochs=2)
    for net in ("student", "teacher"):  # DDP kept the ranks identical after the resume
        for key, value in ranks[0]["resumed"][net].items():
            assert torch.equal(ranks[1]["resumed"][net][key], value)
    # Each rank's generator continues its own stream (the CPU's here; CUDA's states travel the same way).
    assert not torch.equal(ranks[0]["full"]["rng"][0][1], ranks[1]["full"]["rng"][0][1])
    for r in ranks:
        full = dict(r["full"]["rng"])
        assert len(r["resumed"]["rng"]) == 7  # at steps 9 to 15, after the checkpoint of step 9
        for step, state in r["resumed"]["rng"]:
            assert torch.equal(state, full[step]), f"the CPU RNG state at step {step} differs"


# ---------------------------------------------------------------------------------------- LitData shards
def test_shards_resume_mid_epoch_exactly(tmp_path):
    """Shards (8 records a chunk): LitData's loader state in the checkpoint finishes the epoch on the records
    not yet seen, in the uninterrupted run's order, every record once."""
    result = _single(tmp_path, every=3, crash=7, shards=1)
    _check_crash_point(result, 6)
    _assert_exactly_once([result], epochs=1)
    assert result["loader_state"][0]["dataset"]["num_samples_yielded"] == 24  # 6 batches of 4, in the file
    _assert_same_weights(result)


@pytest.mark.slow  # moved out of the default suite (its 10-minute budget)
@pytest.mark.parametrize("workers", [0, 2])
def test_shards_checkpoint_on_an_epochs_last_step_resumes_the_next_epoch(tmp_path, workers):
    """Lightning does not restore the loader from an epoch-end checkpoint: the resumed epoch 1 must still be
    epoch 1's order (the trainer's epoch), not LitData's count of iterators (which restarts at epoch 0's),
    also in persistent workers, which keep their own copy of the epoch."""
    result = _single(tmp_path, epochs=2, every=4, crash=17, shards=1, workers=workers)
    _check_crash_point(result, 16)
    _assert_exactly_once([result], epochs=2)
    if workers == 0:
        _assert_same_weights(result)


@pytest.mark.slow  # moved out of the default suite (its 10-minute budget)
def test_shards_resume_with_workers_and_device_crops_sees_every_record_once(tmp_path):
    result = _single(tmp_path, epochs=2, every=9, crash=20, workers=2, shards=1, augment="device")
    _check_crash_point(result, 18)
    _assert_exactly_once([result], epochs=2)


@pytest.mark.slow  # about 35 s on 2 shared cores
@pytest.mark.distributed
def test_two_processes_on_shards_split_the_epoch_and_resume_mid_epoch_exactly(tmp_path):
    """70 records, 4 a batch, 2 ranks. LitData's drop_last keeps floor(floor(70 / 4) / 2) = 8 full batches a
    rank: 2 x 8 x 4 = 64 records an epoch, and drops the other 6 (the end of the epoch's shuffled order).
    The ranks' shares are disjoint, their union is those 64; the run killed after step 11 (epoch 1) and
    resumed from step 9 sees exactly the rest of epoch 1, in the uninterrupted run's order."""
    torchrun(
        WORKER, str(tmp_path), "2", "epochs=2", "every=3", "crash=11", "images=70", "shards=1", timeout=240
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in ranks:
        _check_crash_point(r, 9)
    _assert_exactly_once(ranks, epochs=2, images=64)
    for epoch in range(2):
        shares = [{i for _, e, ids in r["full"]["seen"] if e == epoch for i in ids} for r in ranks]
        assert len(shares[0]) == len(shares[1]) == 32 and not shares[0] & shares[1]
        assert (shares[0] | shares[1]) <= set(range(70))
    dropped = [set(range(70)) - {i for r in ranks for _, e, ids in r["full"]["seen"] if e == epoch for i in ids}
               for epoch in range(2)]  # fmt: skip
    assert [len(d) for d in dropped] == [6, 6] and dropped[0] != dropped[1]  # reshuffled each epoch


@pytest.mark.slow  # about 60 s on 2 shared cores
@pytest.mark.distributed
def test_two_processes_resume_mid_epoch_exactly_from_s3(tmp_path, s3_env):
    """The 2-process case above with the shards read over HTTP from an S3-compatible server
    (tests/conftest.py): LitData downloads the chunks into each rank's cache, and the resumed epoch is still
    exactly the records not yet seen."""
    torchrun(
        WORKER, str(tmp_path), "2", "epochs=2", "every=3", "crash=11", "images=70", "shards=1", f"s3={s3_env}",
        timeout=400,
    )  # fmt: skip
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in ranks:
        _check_crash_point(r, 9)
    _assert_exactly_once(ranks, epochs=2, images=64)
