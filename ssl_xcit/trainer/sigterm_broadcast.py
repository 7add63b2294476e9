"""No per-step SIGTERM broadcast from Lightning while ``PreemptionCheckpoint`` owns the signal.

Lightning 2.6's training epoch loop broadcasts a SIGTERM flag from rank 0 and reads it with ``.item()`` at the
start of every step under DDP (``_TrainingEpochLoop._broadcast_sigterm_tensor``): a collective and a host
sync per step (Lightning issue 21487). While our handler owns SIGTERM, Lightning's flag
(``trainer.received_sigterm``) is never set, so that broadcast carries 0 on every step; our callback agrees on
its own flag asynchronously over a gloo group. If Lightning gains a setting for the interval (pull request 21640
proposes ``Trainer(broadcast_sigterm_every_n_steps=...)``), that setting is used instead of the override.
"""

from __future__ import annotations

import sys
from typing import Any

SETTING = "broadcast_sigterm_every_n_steps"


def _skip_broadcast() -> None:
    """Lightning's broadcast replaced: our handler owns SIGTERM, so its flag is 0 on every rank."""


def silence(trainer: Any) -> bool:
    """Stop the per-step broadcast of ``trainer``'s epoch loop; True when something was changed. Undo with
    :func:`restore`."""
    loop = trainer.fit_loop.epoch_loop
    for owner in (trainer, loop):
        if hasattr(owner, SETTING):  # upstream's setting: no broadcast within any run
            owner._ssl_xcit_sigterm_every = getattr(owner, SETTING)
            setattr(owner, SETTING, sys.maxsize)
            return True
    if not callable(getattr(type(loop), "_broadcast_sigterm_tensor", None)):
        return False  # a Lightning without the per-step broadcast
    loop._broadcast_sigterm_tensor = _skip_broadcast  # this loop only; the class is left as it is
    return True


def restore(trainer: Any) -> None:
    """Undo :func:`silence`."""
    loop = trainer.fit_loop.epoch_loop
    for owner in (trainer, loop):
        if "_ssl_xcit_sigterm_every" in owner.__dict__:
            setattr(owner, SETTING, owner.__dict__.pop("_ssl_xcit_sigterm_every"))
    if loop.__dict__.get("_broadcast_sigterm_tensor") is _skip_broadcast:
        del loop._broadcast_sigterm_tensor
