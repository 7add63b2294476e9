"""DINOv3's distributed KoLeo (``grouped_koleo_loss``, ``--model.koleo_group_size``) against a brute-force
computation of DINOv3's formula (``dinov3/loss/koleo_loss.py``, ``KoLeoLossDistributed``, topk 1): the global
batch in rank order, cut into groups of consecutive rows; each row's nearest other row of its group; per rank
the mean of -log(||x_i - x_nn + eps|| + eps) over its rows, after L2 normalisation. One process (groups inside
the batch) and 2 gloo processes (groups across ranks, with the gradient that reaches the other rank)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_model, torchrun
from koleo_group_worker import CASES, global_batch

from ssl_xcit.dino.koleo import grouped_koleo_loss, koleo_loss
from ssl_xcit.dino.step import check_settings
from ssl_xcit.errors import UserError

EPS = 1e-8
WORKER = Path(__file__).with_name("koleo_group_worker.py")


def reference_losses(x: torch.Tensor, sizes: list[int], group: int) -> list[torch.Tensor]:
    """Each rank's loss, by loops, in float64: rank r's rows sit at slots r * max(sizes) + i of the global
    batch (DINOv3's layout when every rank has max(sizes) rows); a row without another row in its group is
    left out of its rank's mean."""
    x = torch.nn.functional.normalize(x.double(), dim=1, eps=EPS)
    slots = max(sizes)
    rows, start = [], 0
    for r, n in enumerate(sizes):  # (slot, row of x) of every row
        rows += [(r * slots + i, start + i) for i in range(n)]
        start += n
    losses = []
    for r in range(len(sizes)):
        terms = []
        for slot, i in rows:
            if slot // slots != r:
                continue
            mates = [j for s, j in rows if s // group == slot // group and j != i]
            if not mates:
                continue
            nearest = max(mates, key=lambda j: float(x[i].detach() @ x[j].detach()))
            distance = torch.linalg.vector_norm(x[i] - x[nearest] + EPS)
            terms.append(-torch.log(distance + EPS))
        losses.append(torch.stack(terms).mean() if terms else x.new_zeros(()))
    return losses


@pytest.mark.parametrize("batch, group", [(12, 4), (12, 3), (10, 4), (12, 12)])
def test_one_process_groups_the_batch_as_dinov3(batch, group):
    x = torch.randn(batch, 7, generator=torch.Generator().manual_seed(batch + group), dtype=torch.float64)
    got = x.float().requires_grad_(True)
    loss = grouped_koleo_loss(got, group)
    loss.backward()
    ref_x = x.clone().requires_grad_(True)
    (want,) = reference_losses(ref_x, [batch], group)
    want.backward()
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    torch.testing.assert_close(got.grad.double(), ref_x.grad, rtol=1e-4, atol=1e-6)
    if group == batch:  # one group: DINOv2's per-rank KoLeo
        assert float(loss) == pytest.approx(float(koleo_loss(x.float())), rel=1e-6)


def test_groups_change_the_neighbours():
    # Rows 0, 1 close together, rows 2, 3 close together: in groups of 2 ({0, 1}, {2, 3}) every row keeps its
    # close neighbour; in groups {0, 2}, {1, 3} (rows reordered) every neighbour is the far one.
    x = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [0.1, 1.0]])
    near = grouped_koleo_loss(x, 2)
    far = grouped_koleo_loss(x[[0, 2, 1, 3]], 2)
    assert float(far) < float(near)
    assert float(far) == pytest.approx(float(reference_losses(x[[0, 2, 1, 3]], [4], 2)[0]), rel=1e-6)


def test_the_step_adds_the_weighted_grouped_term_of_the_student_global_embeddings():
    crops = [torch.randn(8, 3, s, s, generator=torch.Generator().manual_seed(s)) for s in (32, 32, 16, 16)]
    torch.manual_seed(0)
    plain = tiny_model(drop_path_rate=0.0, koleo_weight=0.0)
    torch.manual_seed(0)
    grouped = tiny_model(drop_path_rate=0.0, koleo_weight=0.3, koleo_group_size=4)
    off = plain.compute_losses(crops, None, 0, update_center=False)
    on = grouped.compute_losses(crops, None, 0, update_center=False)
    with torch.no_grad():  # one backbone call on both global crops, as the step makes
        embedding = grouped.student.backbone(torch.cat(crops[:2]))
    want = sum(grouped_koleo_loss(view, 4) for view in embedding.chunk(2))
    assert float(on.koleo) == pytest.approx(float(want), rel=1e-5)
    assert float(on.total - off.total) == pytest.approx(0.3 * float(want), rel=1e-4, abs=1e-6)
    assert float(want) != pytest.approx(sum(float(koleo_loss(v)) for v in embedding.chunk(2)), rel=1e-3)


def test_bad_group_sizes_are_one_line():
    hp = dict(
        sync_every_n_steps=1, accumulate_grad_batches=1, teacher_temp=0.04, warmup_teacher_temp=0.04,
        student_temp=0.1, koleo_weight=0.1, ibot_loss_weight=0.0, out_dim=8, ibot_out_dim=None,
        ibot_separate_head=True,
    )  # fmt: skip
    for bad in (1, 0, 2.5, True, "16"):
        with pytest.raises(UserError, match=f"koleo_group_size must be an integer >= 2.*got {bad!r}"):
            check_settings({**hp, "koleo_group_size": bad})
    check_settings({**hp, "koleo_group_size": 16})


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("koleo_group")
    torchrun(WORKER, str(out), timeout=120)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.slow  # a 2-process launch: ~40 s on 2 cores
@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_dinov3s_formula_with_the_gradient_across_ranks(ranks, case):
    n0, n1, group = CASES[case]
    x = global_batch(case).clone().requires_grad_(True)
    want = reference_losses(x, [n0, n1], group)
    sum(want).backward()  # each rank's features get the gradient of every rank's term (the gather's backward)
    for r in range(2):
        assert float(ranks[r][case]["loss"]) == pytest.approx(float(want[r]), rel=1e-5)
    got = torch.cat([ranks[0][case]["grad"], ranks[1][case]["grad"]]).double()
    torch.testing.assert_close(got, x.grad, rtol=1e-4, atol=1e-6)
