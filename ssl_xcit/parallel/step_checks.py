"""The checks DINO's step needs across ranks, made without stopping the GPU queue every step.

- :class:`FiniteWatch`: a non-finite loss is recorded on the device (a flag, the first bad step, its value)
  and read on the host once every ``sync_every_n_steps`` steps, before any checkpoint is written, and at
  each epoch's end. Reading ``bool(torch.isfinite(loss))`` every step would wait for the whole step's kernels.
  At the same reads, under ``16-mixed``, :func:`loss_scale_collapsed` stops a run whose GradScaler skips every
  step while the loss stays finite (float16 gradients that overflow at any scale): silently, no weight moves.
- :class:`HostAgreement`: whether any rank must skip a batch is a host fact (its loader gave no image), so
  the ranks agree on the host, over a CPU (gloo) process group made once; an all-reduce of a CUDA tensor
  would be read back after every kernel already queued. It is a blocking host round trip every step (a
  fraction of a millisecond), but it does not wait for any GPU: the ranks' hosts meet at the step's start,
  which DDP's gradient all-reduce makes them do one step later anyway. Agreeing less often is not possible:
  a rank with no image must be known before the step's first collective.

:func:`host_group` is the one gloo group every host-side agreement shares (this one and
``PreemptionCheckpoint``'s), so a run opens one set of gloo connections beside NCCL.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ssl_xcit.errors import TrainingDiverged, UserError

_HOST_GROUP: tuple[object, dist.ProcessGroup] | None = None  # (the default group it belongs to, the group)


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


# GradScaler halves its scale (from 65536) at every step whose float16 gradients hold an inf or NaN and doubles
# it after 2000 clean steps. Below 1 the gradients overflow even unscaled, in true units: nothing a loss scale
# can fix, and reached only after 17 skipped steps in a row from the start (healthy runs sit at 2^10-2^16).
MIN_LOSS_SCALE = 1.0


def loss_scale_collapsed(
    scale: float, step: int, loss: float | None, epoch: int, checkpoint: str | None
) -> TrainingDiverged | None:
    """The error for a GradScaler whose ``scale`` (the smallest over the ranks) fell below
    :data:`MIN_LOSS_SCALE` by optimiser ``step``, or None while it has not."""
    if scale >= MIN_LOSS_SCALE:
        return None
    return TrainingDiverged(
        f"16-mixed: the GradScaler skipped optimiser steps until its loss scale fell to {scale:.3g} (below "
        f"{MIN_LOSS_SCALE:g}) by global step {step} (epoch {epoch}) while the loss stayed finite ({loss}): the "
        "float16 gradients hold inf or NaN at any scale, so the weights no longer move; training stopped. Last "
        f"good checkpoint: {checkpoint or 'none saved yet'}. Use --trainer.precision bf16-mixed or 32, or a "
        "lower lr or clip_grad."
    )


def host_group() -> dist.ProcessGroup:
    """A gloo group over every rank for agreeing on host values, made on the first call (a collective: every
    rank must make that call at the same point) and shared until the default group changes. Always a group of
    its own, even when the default group is gloo, so a rank's asynchronous agreement never interleaves with
    DDP's collectives on the default group."""
    global _HOST_GROUP
    world = dist.group.WORLD
    if _HOST_GROUP is None or _HOST_GROUP[0] is not world:
        _HOST_GROUP = (world, new_gloo_group())
    return _HOST_GROUP[1]


def new_gloo_group() -> dist.ProcessGroup:
    """``new_group(backend="gloo")``, with a one-line :class:`UserError` when gloo cannot connect."""
    try:
        return dist.new_group(backend="gloo")
    except RuntimeError as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        raise UserError(
            f"could not open the gloo process group the ranks agree on host values through "
            f"({lines[-1] if lines else type(err).__name__}); gloo takes the network interface of this host's "
            "name, which other nodes may not reach: set GLOO_SOCKET_IFNAME to an interface they do reach "
            "(as NCCL_SOCKET_IFNAME, e.g. GLOO_SOCKET_IFNAME=ib0); see docs/cluster.md"
        ) from err


class HostAgreement:
    """``any`` of a host boolean over all ranks, decided on the host (a gloo group under NCCL)."""

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any. Every rank must call it at the same point (the
        first call may make the group, a collective too)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return bool(flag)
        vote = torch.tensor([int(bool(flag))], dtype=torch.int32, device="cpu")
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=host_group())  # NCCL moves only device tensors
        return bool(vote.item())  # a CPU tensor: no device involved
