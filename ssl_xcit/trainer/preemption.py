"""Pre-emption: ``SIGTERM``, or SLURM's ``SIGUSR1`` warning, saves a complete checkpoint and ends the run.

:class:`PreemptionCheckpoint` (``ssl-xcit fit`` adds it to every run) turns either signal into a flag. At the
next point where nothing is half done (the end of a training batch that closes an accumulation window, or
the end of an epoch) every rank agrees on the flag, the run writes ``checkpoints/last.ckpt`` through
``Trainer.save_checkpoint`` (the same state a step checkpoint holds: weights, optimiser, RNG, loop progress
and the training loader's position), and the process exits with status ``128 + signal`` (143 for SIGTERM,
138 for SIGUSR1), as a process ended by that signal reports. With ``SIGUSR1`` inside a SLURM job, rank 0 then
runs ``scontrol requeue <job>``; the requeued job finds its run folder and resumes from that checkpoint
(``ssl_xcit.cli.rundir.requeued_run``). docs/cluster.md has the SLURM script.

Why not Lightning's own handlers: its SLURM handler (``SLURMEnvironment(auto_requeue=True)``) writes the
checkpoint inside the signal handler, wherever the main thread was: in the middle of an optimiser step, or
with a batch taken from the loader but not trained on (the resumed run would then skip it), and under DDP it
enters a barrier from a signal handler. Its SIGTERM handling stops after the current batch without saving.
Lightning's SIGTERM handler is worse under DDP: it broadcasts on the default group from inside the signal
handler, so a signal that reaches one rank only (during sanity validation, say) leaves it waiting for a
broadcast the others never enter. This callback owns both signals for the whole fit: it installs its handlers
in ``setup`` (before Lightning looks, so Lightning adds no ``SIGUSR1`` handler) and takes ``SIGTERM`` back
right after Lightning registers its own (just before sanity validation), and again when training starts.

A signal before training (checkpoint restore, sanity validation, ``on_train_start`` work of the callbacks
before this one) is agreed at ``on_train_start`` with one blocking all-reduce, and the run saves and stops
there. During training the time from the signal to a written checkpoint is at most the rest of the current
accumulation window, one more window (the agreement is read a window later) and the checkpoint write
(docs/cluster.md compares it with SLURM's ``KillWait``).

Ranks agree through the run's gloo group for host values (``step_checks.host_group``), asynchronously: the flag of step ``s`` is all-reduced
while step ``s + 1`` trains and read at its end, so no step waits for it (and no GPU sync is added).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ssl_xcit.parallel.step_checks import host_group
from ssl_xcit.trainer import sigterm_broadcast

HANDLED = (signal.SIGTERM, signal.SIGUSR1)
REQUEUE_SIGNAL = signal.SIGUSR1


class Preempted(SIGTERMException):
    """The run saved its checkpoint after a signal and exits with status ``128 + signal``."""

    def __init__(self, signum: int, checkpoint: Path) -> None:
        super().__init__(128 + signum)
        self.signum, self.checkpoint = signum, checkpoint


def slurm_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The id ``scontrol requeue`` takes for this job (``<array job>_<task>`` for an array task), or None."""
    env = os.environ if env is None else env
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or None


def requeue(job_id: str) -> str | None:
    """``scontrol requeue job_id``; None on success, else why it failed (one line)."""
    try:
        done = subprocess.run(
            ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"scontrol requeue {job_id} could not run: {err}"
    if done.returncode != 0:
        return f"scontrol requeue {job_id} exited {done.returncode}: {(done.stderr or done.stdout).strip()}"
    return None


class PreemptionCheckpoint(L.Callback):
    """On ``SIGTERM`` or ``SIGUSR1``: save ``last.ckpt`` at the next safe point, requeue a SLURM job on
    ``SIGUSR1``, exit with status ``128 + signal`` (see the module docstring).

    Args:
        requeue: run ``scontrol requeue`` after a ``SIGUSR1`` inside a SLURM job (``SLURM_JOB_ID`` set).
    """

    def __init__(self, requeue: bool = True) -> None:
        self.requeue = requeue
        self.received = 0  # the first signal number seen, 0 for none
        self._active = False
        self._previous: dict[int, Any] = {}
        self._group: Any = None
        self._pending: Any = None
        self._buffer: torch.Tensor | None = None

    # ------------------------------------------------------------------------------------------- signals
    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._active:
            self.received = self.received or signum  # only a flag: the main thread acts on it
            return
        # Outside a fit the signal means what it meant before this callback.
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _install(self, signums: tuple[int, ...]) -> None:
        if threading.current_thread() is not threading.main_thread():
            rank_zero_warn("PreemptionCheckpoint: not on the main thread, so no signal handler was installed")
            return
        for signum in signums:
            current = signal.getsignal(signum)
            if current != self._on_signal:
                self._previous.setdefault(signum, current)
                signal.signal(signum, self._on_signal)

    def _uninstall(self) -> None:
        self._active = False
        if threading.current_thread() is threading.main_thread():
            for signum, previous in self._previous.items():
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        # `_previous` stays: Lightning's teardown may put this handler back, which then passes signals on.

    # --------------------------------------------------------------------------------------------- hooks
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.received, self._active = 0, True
        self._install(HANDLED)  # before Lightning registers its own: it then adds no SIGUSR1 handler
        self._reclaim_after_lightning(trainer)
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            # Collective: every rank runs setup. CPU tensors, so agreeing never syncs a GPU.
            self._group = host_group()

    def _reclaim_after_lightning(self, trainer: L.Trainer) -> None:
        """Take SIGTERM back as soon as Lightning's signal connector has replaced it (it registers after
        restoring a checkpoint, before sanity validation), so no signal ever reaches its handler. Wrapping
        the connector's method on this trainer alone is the least invasive hook Lightning 2.x offers; without
        the private connector, ``on_train_start`` still takes the signal back."""
        connector = getattr(trainer, "_signal_connector", None)
        register = getattr(connector, "register_signal_handlers", None)
        if register is None or getattr(register, "_reclaims_sigterm", False):
            return

        def register_then_reclaim() -> None:
            register()
            self._install((signal.SIGTERM,))

        register_then_reclaim._reclaims_sigterm = True  # type: ignore[attr-defined]
        connector.register_signal_handlers = register_then_reclaim

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install((signal.SIGTERM,))  # in case Lightning's connector could not be wrapped
        # A signal that came before training (restore, sanity validation, the k-NN monitor's first pass) is
        # acted on now, before the first window, rather than two windows into training. Once per fit. The
        # same all-reduce decides whether SIGTERM is ours on every rank.
        signum, owned_everywhere = self._agree_at_start(signal.getsignal(signal.SIGTERM) == self._on_signal)
        if owned_everywhere:  # Lightning's per-step SIGTERM check has nothing to find on any rank
            sigterm_broadcast.silence(trainer)
        elif signal.getsignal(signal.SIGTERM) == self._on_signal:
            rank_zero_warn(
                "PreemptionCheckpoint: another rank could not install its SIGTERM handler, so Lightning's "
                "per-step SIGTERM broadcast stays on every rank (one broadcasting alone would hang the run)"
            )
        if signum:
            self._stop(trainer, signum)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._window_closed(trainer, pl_module, batch_idx):
            return  # gradients of a partial accumulation window would be lost
        signum = self._agree(blocking=False)
        if signum:
            self._stop(trainer, signum)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        signum = self._agree(blocking=True)  # once an epoch: a signal during epoch-end work acts here
        if signum:
            self._stop(trainer, signum)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._finish()
            sigterm_broadcast.restore(trainer)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._finish()
        sigterm_broadcast.restore(trainer)

    def _finish(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        self._uninstall()

    # -------------------------------------------------------------------------------------------- logic
    @staticmethod
    def _window_closed(trainer: L.Trainer, pl_module: L.LightningModule, batch_idx: int) -> bool:
        """No gradient is pending after this batch: it ends an accumulation window (DINO's own under manual
        optimisation, else the Trainer's), or it lies past the epoch's last full window (dropped)."""
        if pl_module.automatic_optimization:
            accumulate = trainer.accumulate_grad_batches
        else:
            accumulate = int(getattr(pl_module, "hparams", {}).get("accumulate_grad_batches", 1))
        batches = trainer.num_training_batches
        full = int(batches) // accumulate * accumulate if batches != float("inf") else None
        return (batch_idx + 1) % accumulate == 0 or (full is not None and batch_idx >= full)

    def _agree_at_start(self, owns: bool) -> tuple[int, bool]:
        """(the signal any rank received, whether every rank owns SIGTERM), the same on every rank: the ranks
        silence Lightning's per-step broadcast together or not at all. One blocking all-reduce (max)."""
        if self._group is None:
            return self.received, owns
        vote = torch.tensor([self.received, int(not owns)], dtype=torch.int64)
        torch.distributed.all_reduce(vote, op=torch.distributed.ReduceOp.MAX, group=self._group)
        signum, someone_does_not = vote.tolist()  # CPU tensors: no device involved
        return int(signum), not someone_does_not

    def _agree(self, blocking: bool) -> int:
        """The signal any rank received (the largest number), the same on every rank at the same point."""
        if self._group is None:
            return self.received
        dist = torch.distributed
        decided = 0
        if self._pending is not None:
            self._pending.wait()
            decided = int(self._buffer.item())
            self._pending = None
        if decided:
            return decided
        flag = torch.tensor([self.received], dtype=torch.int64)
        if blocking:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            return int(flag.item())
        self._buffer = flag
        self._pending = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return 0

    @staticmethod
    def checkpoint_path(trainer: L.Trainer) -> Path:
        """Where ``last.ckpt`` goes: the folder of the checkpoint callback that writes it, else
        ``<default_root_dir>/checkpoints``."""
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath:
                if callback.filename == callback.CHECKPOINT_NAME_LAST or callback.save_last:
                    name = callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION
                    return Path(callback.dirpath) / name
        return Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"

    def _stop(self, trainer: L.Trainer, signum: int) -> None:
        path = self.checkpoint_path(trainer)
        trainer.save_checkpoint(path)  # every rank takes part; rank 0 writes (atomically), then a barrier
        name = signal.Signals(signum).name
        done = (
            f"{name} received: saved {path} at step {trainer.global_step} (epoch {trainer.current_epoch}, "
            f"batch {trainer.fit_loop.epoch_loop.batch_progress.current.completed + 1} of the epoch)"
        )
        job = slurm_job_id()
        if signum == REQUEUE_SIGNAL and self.requeue and job is not None:
            failure = requeue(job) if trainer.is_global_zero else None
            if failure:
                rank_zero_warn(f"{done}; could not requeue: {failure}; resume it with --ckpt_path {path}")
            else:
                rank_zero_info(
                    f"{done}; requeued SLURM job {job}: it resumes from there in the same run folder"
                )
        else:
            rank_zero_info(f"{done}; resume with --ckpt_path last (or --ckpt_path {path})")
        raise Preempted(signum, path)
