"""The collectives beside DDP's, on 2 gloo processes in one launch (``collectives_worker.py`` describes the
cases): AllReduceBatchNorm equals one BatchNorm over the concatenated batch (outputs, input and parameter
gradients, running statistics); the gloo group for host agreement is made once, and a group that cannot form
is a one-line error naming GLOO_SOCKET_IFNAME."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from collectives_worker import CASES, batch, upstream
from conftest import torchrun
from torch import nn

WORKER = Path(__file__).with_name("collectives_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("collectives")
    torchrun(WORKER, str(out), timeout=120)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_allreduce_batchnorm_equals_batchnorm_over_the_concatenated_batch(ranks, case):
    n0, n1, momentum = CASES[case]
    ranks = [r["syncbn"] for r in ranks]
    reference = nn.BatchNorm2d(3, momentum=momentum).double()
    with torch.no_grad():
        reference.weight.copy_(torch.tensor([1.0, 0.5, 2.0]))
        reference.bias.copy_(torch.tensor([0.0, 1.0, -1.0]))
    for step in range(3):
        x = batch(step)[: n0 + n1].double().requires_grad_(True)
        y = reference(x)
        y.backward(upstream(step)[: n0 + n1].double())
        got_y = torch.cat([r[case]["steps"][step]["y"] for r in ranks])
        got_grad = torch.cat([r[case]["steps"][step]["x_grad"] for r in ranks])
        torch.testing.assert_close(got_y.double(), y.detach(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_grad.double(), x.grad, rtol=1e-4, atol=1e-4)
    for name in ("weight_grad", "bias_grad"):  # each rank's gradient is its part's; DDP sums (averages) them
        total = ranks[0][case][name] + ranks[1][case][name]
        expected = getattr(reference, name.split("_")[0]).grad
        torch.testing.assert_close(total.double(), expected, rtol=1e-4, atol=1e-4)
    for r in ranks:  # every rank tracks the global statistics
        torch.testing.assert_close(
            r[case]["running_mean"].double(), reference.running_mean, rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            r[case]["running_var"].double(), reference.running_var, rtol=1e-5, atol=1e-5
        )
        assert int(r[case]["num_batches_tracked"]) == 3


@pytest.mark.distributed
def test_a_gloo_group_that_cannot_form_names_gloo_socket_ifname(ranks):
    for r in (r["host_group"] for r in ranks):
        assert r["error"] is not None and "\n" not in r["error"]
        assert "set GLOO_SOCKET_IFNAME" in r["error"] and "no_such_interface0" in r["error"]
        assert r["shared"]  # made once, and not the default group
        assert r["votes"] == [True, False]  # rank 1's flag reaches rank 0
