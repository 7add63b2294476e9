"""``ssl_xcit.dino.optimizer_step``: the explicit gradient reduction of a window whose closing micro-batch was
skipped, on one process with the other rank's all-reduce contribution simulated."""

from __future__ import annotations

import torch
from torch import nn

from ssl_xcit.dino.optimizer_step import reduce_local_gradients


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
