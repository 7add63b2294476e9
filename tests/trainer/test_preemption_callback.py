"""``PreemptionCheckpoint`` in one process: a signal in the middle of an accumulation window stops the run at
the window's end (never with gradients of a partial window pending), after writing a checkpoint that holds
the loader's position; outside a fit the signal keeps its previous meaning."""

from __future__ import annotations

import os
import signal

import lightning as L
import pytest
import torch

from ssl_xcit.data.datasets import collate_train
from ssl_xcit.data.resumable import resumable_loader
from ssl_xcit.trainer.preemption import Preempted, PreemptionCheckpoint, slurm_job_id


class SignalAt(L.Callback):
    """Sends ``signum`` to this process at the start of batch ``at``."""

    def __init__(self, signum: int, at: int) -> None:
        self.signum, self.at = signum, at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at:
            os.kill(os.getpid(), self.signum)


def test_signal_mid_window_stops_at_the_window_end_with_a_complete_checkpoint(tmp_path, tiny, monkeypatch):
    from conftest import RandomCrops

    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    model = tiny.model(accumulate_grad_batches=2)
    preemption = PreemptionCheckpoint()
    trainer = tiny.trainer(tmp_path, max_epochs=1, callbacks=[SignalAt(signal.SIGTERM, 2), preemption])
    loader = resumable_loader(RandomCrops(32), 4, collate_train)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted) as stopped:
        trainer.fit(model, loader)
    assert stopped.value.code == 128 + signal.SIGTERM
    # Batch 2 opened window 2 (batches 2, 3): the run stopped after batch 3, on optimiser step 2.
    assert trainer.global_step == 2
    assert all(p.grad is None for p in model.student.parameters())
    checkpoint = torch.load(stopped.value.checkpoint, weights_only=False)
    assert stopped.value.checkpoint == tmp_path / "ckpt" / "last.ckpt"
    assert checkpoint["global_step"] == 2
    position = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert position["_num_yielded"] == 4  # batches 0-3 taken, none read ahead
    # Lightning's teardown puts back the handler it found at the start (ours), which is now inactive: it
    # passes a later signal to the handler from before the fit (test below).
    assert signal.getsignal(signal.SIGTERM) in (before, preemption._on_signal) and not preemption._active


def test_outside_a_fit_the_previous_handler_runs():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        callback = PreemptionCheckpoint()
        callback._install((signal.SIGUSR1,))
        callback._active = False  # installed, but no fit running (Lightning re-installs handlers it saw)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] and callback.received == 0
        callback._uninstall()
        assert signal.getsignal(signal.SIGUSR1) is not callback._on_signal
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_slurm_job_id_names_an_array_task_as_scontrol_takes_it():
    assert slurm_job_id({"SLURM_JOB_ID": "17"}) == "17"
    assert (
        slurm_job_id({"SLURM_JOB_ID": "18", "SLURM_ARRAY_JOB_ID": "9", "SLURM_ARRAY_TASK_ID": "2"}) == "9_2"
    )
    assert slurm_job_id({}) is None


@pytest.mark.distributed
def test_a_signal_to_one_rank_stops_both_after_the_same_step(tmp_path):
    """2 gloo processes; only rank 1 is signalled (at its batch 2). The flag is agreed one step later
    (asynchronously), so both stop after step 4, write one checkpoint and exit with 143."""
    from pathlib import Path

    from conftest import torchrun

    torchrun(Path(__file__).with_name("preemption_worker.py"), str(tmp_path), timeout=240)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["code"] for r in ranks] == [128 + signal.SIGTERM] * 2
    assert [r["global_step"] for r in ranks] == [4, 4]
    checkpoint = torch.load(ranks[0]["checkpoint"], weights_only=False)
    assert checkpoint["global_step"] == 4
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["_num_yielded"] == 4


@pytest.mark.slow  # moved out of the default suite (its 10-minute budget)
@pytest.mark.distributed
def test_a_signal_to_one_rank_before_training_stops_both_at_train_start(tmp_path):
    """2 gloo processes; only rank 1 is signalled, during sanity validation (before ``on_train_start``).
    Lightning's handler would broadcast from inside the signal handler on rank 1 alone, and the run would hang
    (``TimeoutExpired``); the callback owns the signal from ``setup``, so both ranks agree at
    ``on_train_start``, save before the first step and exit with 143."""
    from pathlib import Path

    from conftest import torchrun

    torchrun(Path(__file__).with_name("preemption_worker.py"), str(tmp_path), "sanity", timeout=120)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["code"] for r in ranks] == [128 + signal.SIGTERM] * 2
    assert [r["global_step"] for r in ranks] == [0, 0]
    checkpoint = torch.load(ranks[0]["checkpoint"], weights_only=False)
    assert checkpoint["global_step"] == 0 and checkpoint["state_dict"]
