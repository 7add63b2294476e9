"""The checks DINO's step needs across ranks, made without stopping the GPU queue every step.

- :class:`FiniteWatch`: a non-finite loss is recorded on the device (a flag, the first bad step, its value)
  and read on the host once every ``sync_every_n_steps`` steps, before any checkpoint is written, and at
  each epoch's end. Reading ``bool(torch.isfinite(loss))`` every step would wait for the whole step's kernels.
- :class:`HostAgreement`: whether any rank must skip a batch is a host fact (its loader gave no image), so
  the ranks agree on the host, over a CPU (gloo) process group made once; an all-reduce of a CUDA tensor
  would be read back after every kernel already queued.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ssl_xcit.errors import TrainingDiverged


class FiniteWatch:
    """Accumulates on the device whether a loss was non-finite since the last read, with its step and value."""

    def __init__(self) -> None:
        self._state: torch.Tensor | None = None  # (bad, first bad step, its loss), float32 on the device
        self._last: torch.Tensor | None = None  # the last loss observed, on the device
        self.window: tuple[int, int] | None = None  # first and last step observed since the last read
        self.last_loss: float | None = None  # the last loss (mean over the ranks) as of the last read

    @torch.no_grad()
    def observe(self, loss: torch.Tensor, step: int) -> None:
        """Record ``loss`` of optimiser ``step``: device operations only."""
        value = loss.detach().float().reshape(())
        row = torch.stack((torch.ones_like(value), torch.full_like(value, float(step)), value))
        if self._state is None:
            self._state = torch.zeros_like(row)
        first = ~torch.isfinite(value) & (self._state[0] == 0)
        self._state = torch.where(first, row, self._state)
        self._last = value
        self.window = (step if self.window is None else self.window[0], step)

    @property
    def pending(self) -> bool:
        return self.window is not None

    def read(
        self, gather: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[int, float, tuple[int, int]] | None:
        """``(first bad step, its loss, observed window)`` over all ranks, or None when every loss was finite.
        ``gather`` maps this rank's state to every rank's (e.g. ``strategy.all_gather``); every rank must
        call ``read`` at the same point. One host read, which also gives ``last_loss`` (the progress bar's
        value); the watch starts a new window."""
        if self._state is None:
            return None
        rows = gather(torch.cat((self._state, self._last.reshape(1)))).reshape(-1, 4).cpu().tolist()
        self.last_loss = sum(row[3] for row in rows) / len(rows)
        window = self.window
        self._state, self._last, self.window = None, None, None
        bad = [(int(step), value) for flag, step, value, _ in rows if flag]
        if not bad:
            return None
        step, value = min(bad)
        return step, value, window


def diverged(
    found: tuple[int, float, tuple[int, int]], epoch: int, every: int, checkpoint: str | None
) -> TrainingDiverged:
    """The error for :meth:`FiniteWatch.read`'s finding, naming the step, the window and the way back."""
    step, value, (first, last) = found
    return TrainingDiverged(
        f"DINO loss is {value} at global step {step} (epoch {epoch}; found by the check of steps "
        f"{first}-{last}, sync_every_n_steps={every}); training stopped. Last good checkpoint: "
        f"{checkpoint or 'none saved yet'}. Resume from it with --ckpt_path after lowering lr, using "
        "--trainer.precision 32 (fp16 is unstable for 8x8 patches), or a lower clip_grad."
    )


class HostAgreement:
    """``any`` of a host boolean over all ranks, decided on the host (a gloo group under NCCL)."""

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None
        self._made = False

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any. Every rank must call it at the same point (the
        first call makes the group, a collective too)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return bool(flag)
        if not self._made:
            # The default group serves when it is gloo already; NCCL moves only device tensors.
            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
            self._made = True
        vote = torch.tensor([int(bool(flag))], dtype=torch.int32, device="cpu")
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self._group)
        return bool(vote.item())  # a CPU tensor: no device involved
