"""Switching a module to eval mode for a while, and putting every submodule back as it was."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """Run the body with ``module`` in eval mode; on exit each submodule gets back its own previous mode.

    ``module.train(was_training)`` is not enough: it would flatten a mixed state (a DINO teacher kept in
    train mode inside an otherwise evaluating model, a frozen backbone inside a training probe).
    """
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, training in modes:
            m.training = training
