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


def test_a_first_fused_sgd_step_skipped_on_overflow_leaves_no_uninitialised_momentum(monkeypatch):
    """Under a GradScaler a first step whose gradients overflow is skipped. torch's fused SGD made its momentum
    buffers with ``empty_like`` before the kernel and kept them when the kernel skipped: uninitialised memory
    (NaN here, to make it visible) became the momentum of every later step."""
    real_empty_like = torch.empty_like
    monkeypatch.setattr(
        torch, "empty_like", lambda t, **kw: torch.full_like(real_empty_like(t, **kw), float("nan"))
    )

    def train(fused: bool) -> torch.Tensor:
        param = torch.nn.Parameter(torch.ones(3))
        opt = build_optimizer("sgd", [{"params": [param]}], fused=fused)
        opt.param_groups[0]["lr"] = 0.1
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        for grad in (float("inf"), 1.0, 2.0):  # the first step overflows and is skipped
            scaler.scale(torch.ones(()))  # (the loss's scaling makes the scale)
            param.grad = torch.full_like(param, grad * scaler.get_scale())
            scaler.step(opt)
            scaler.update()
        return param.detach()

    torch.testing.assert_close(train(True), train(False), rtol=1e-6, atol=1e-7)


def test_fused_sgd_over_sharded_parameters_is_refused_when_built():
    """torch has no DTensor rule for ``aten._fused_sgd_``: under FSDP2 a fused SGD crashed at its first step
    (``NotImplementedError``, the matrix's fused FSDP2 rows). It is refused when built, in one line; fused
    AdamW has the rule and stays allowed. Two fake ranks: no collective runs."""
    import pytest
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ssl_xcit.dino.optim import build_optimizer
    from ssl_xcit.errors import UserError

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        param = torch.nn.Parameter(DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)]))
        with pytest.raises(UserError, match=r"fused sgd .*sharded.*fused_optimizer false"):
            build_optimizer("sgd", [{"params": [param]}], fused=True)
        param.grad = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])
        build_optimizer("adamw", [{"params": [param]}], fused=True).step()
        build_optimizer("sgd", [{"params": [param]}], fused=False).step()
    finally:
        dist.destroy_process_group()
