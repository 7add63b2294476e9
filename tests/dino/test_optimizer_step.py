"""``ssl_xcit.dino.optimizer_step``: the explicit gradient reduction of a window whose closing micro-batch was
skipped, on one process with the other rank's all-reduce contribution simulated, and a window's gradient as the
mean over its readable micro-batches. A fit whose window steps on that mean is the invariant matrix's
``skipped = readable mean`` column (tests/invariants, on 1 and 2 processes)."""

from __future__ import annotations

import torch
from torch import nn

from ssl_xcit.dino.optimizer_step import mean_over_readable, reduce_local_gradients


def _params(*grads: torch.Tensor | None) -> list[nn.Parameter]:
    params = []
    for i, grad in enumerate(grads):
        p = nn.Parameter(torch.zeros(i + 2))
        p.grad = grad
        params.append(p)
    return params


def test_reduce_averages_and_keeps_none_only_where_every_rank_has_none():
    """Rank 0 has gradients for parameters 0 and 2, rank 1 (simulated) for 0 and 1; parameter 3 has none on
    either. DDP's average: (g0 + g1) / 2 with a missing gradient counting as zero; parameter 3 stays None."""
    mine = _params(torch.tensor([1.0, 2.0]), None, torch.tensor([4.0, 6.0, 8.0, 10.0]), None)
    frozen = nn.Parameter(torch.zeros(1), requires_grad=False)
    other = [torch.tensor([3.0, -2.0]), torch.tensor([9.0, 9.0, 3.0]), None, None]

    def all_reduce(flat: torch.Tensor) -> None:  # adds rank 1's buffer, laid out as the function lays it out
        parts = [g if g is not None else torch.zeros(p.numel()) for g, p in zip(other, mine, strict=True)]
        flags = torch.tensor([float(g is not None) for g in other])
        flat += torch.cat([*parts, flags])

    reduce_local_gradients([*mine, frozen], world_size=2, all_reduce=all_reduce)
    torch.testing.assert_close(mine[0].grad, torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(mine[1].grad, torch.tensor([4.5, 4.5, 1.5]))
    torch.testing.assert_close(mine[2].grad, torch.tensor([2.0, 3.0, 4.0, 5.0]))
    assert mine[3].grad is None and frozen.grad is None


def test_fsdp2_gradients_are_left_as_their_backward_reduced_them():
    """Under FSDP2 every backward reduce-scatters (Lightning blocks only DDP's sync inside a window), so a window
    whose closing micro-batch every rank skipped holds reduced gradient shards already: reducing them again
    crashed on the DTensor (the matrix's ``2-one_rank-...-fsdp2`` row) and would have summed different shards.
    A plain parameter in the same list is still reduced. Two fake ranks: no collective runs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        local = torch.tensor([[1.0, 2.0, 3.0]])
        sharded = nn.Parameter(DTensor.from_local(torch.zeros(1, 3), mesh, [Shard(0)]))
        sharded.grad = DTensor.from_local(local.clone(), mesh, [Shard(0)])
        (plain,) = _params(torch.tensor([2.0, 4.0]))

        def all_reduce(flat: torch.Tensor) -> None:  # rank 1 has the same plain gradient
            flat.mul_(2)

        reduce_local_gradients([sharded, plain], world_size=2, all_reduce=all_reduce)
        assert isinstance(sharded.grad, DTensor) and torch.equal(sharded.grad.to_local(), local)
        torch.testing.assert_close(plain.grad, torch.tensor([2.0, 4.0]))
    finally:
        dist.destroy_process_group()


def test_a_window_with_skipped_micro_batches_steps_on_the_readable_ones_mean():
    """Each backward adds loss / k; with r of k micro-batches readable the window's gradient is their mean
    (sum x k / r), not their sum / k, which would shrink the step, the clip and SGD's update by r / k. A
    window with every micro-batch readable, or none, is left alone (no step runs on the latter)."""
    k, grads = 3, [torch.tensor([3.0, -6.0]), torch.tensor([1.0, 2.0])]  # two readable micro-batches
    (param,) = _params(sum(g / k for g in grads))
    mean_over_readable([param], readable=2, length=k)
    torch.testing.assert_close(param.grad, (grads[0] + grads[1]) / 2)
    (whole,) = _params(torch.tensor([1.0, 2.0]))
    mean_over_readable([whole], readable=3, length=3)
    mean_over_readable([whole], readable=0, length=3)
    assert torch.equal(whole.grad, torch.tensor([1.0, 2.0]))
