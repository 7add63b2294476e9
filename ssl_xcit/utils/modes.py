"""Evaluating a caller's module for a while, then handing it back as it came: modes, and devices."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def eval_mode(module: nn.Module, device: str | torch.device | None = None) -> Iterator[nn.Module]:
    """Run the body with ``module`` in eval mode, and on ``device`` when given; on exit each submodule gets back
    its own previous mode, and each parameter, gradient and buffer its own tensor (so its device).

    ``module.train(was_training)`` is not enough: it would flatten a mixed state (a DINO teacher kept in
    train mode inside an otherwise evaluating model, a frozen backbone inside a training probe). Likewise a
    module taken to another device for evaluation (a GPU teacher evaluated on the CPU) must come back where the
    caller's optimiser and training loop expect it. The original tensors are put back rather than copied back,
    so the return trip costs nothing and is exact; the body must not change the weights (evaluation does not).
    """
    modes = [(m, m.training) for m in module.modules()]
    params, buffers = [], []
    if device is not None:
        for m in module.modules():
            for name, p in m.named_parameters(recurse=False):
                grad = p.grad
                params.append((m, name, p, p.data, grad, None if grad is None else grad.data))
            buffers += [(m, name, b) for name, b in m.named_buffers(recurse=False)]
    module.eval()
    try:
        if device is not None:
            module.to(device)
        yield module
    finally:
        for m, training in modes:
            m.training = training
        for m, name, p, data, grad, grad_data in params:
            if getattr(m, name) is not p:  # a conversion that made a new Parameter: hand back the caller's
                setattr(m, name, p)
            p.data = data  # the same Parameter object: optimisers and hooks holding it stay valid
            if grad is not None:
                grad.data = grad_data
                p.grad = grad
        for m, name, b in buffers:
            setattr(m, name, b)
