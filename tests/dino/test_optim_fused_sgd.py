"""Fused SGD when a parameter gets its first gradient after the others (found by the invariant matrix:
``init_from``'s head warm-up with ``fused_optimizer: true`` stopped at the first step the backbone trained)."""

from __future__ import annotations

import torch

from ssl_xcit.dino.optim import build_optimizer


def _train(fused: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    head, backbone = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))
    opt = build_optimizer("sgd", [{"params": [head, backbone]}], fused=fused)
    for group in opt.param_groups:
        group["lr"] = 0.1
    for step in range(3):
        head.grad = torch.full_like(head, 1.0 + step)
        # The backbone waits one step (init_from's warm-up, or the last layer's freeze): no gradient there.
        backbone.grad = None if step == 0 else torch.full_like(backbone, 2.0 - step)
        opt.step()
    return [head.detach(), backbone.detach()]


def test_fused_sgd_steps_a_parameter_whose_first_gradient_comes_late_as_torch_default_does():
    fused, reference = _train(True), _train(False)
    for ours, theirs in zip(fused, reference, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
