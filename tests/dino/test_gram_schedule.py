"""Gram anchoring's schedule (``ssl_xcit.dino.gram``, ``ssl_xcit.dino.schedules``): the Gram teacher's snapshot and
DINOv3's refresh rule, DINOv3's cosine weight ramp, each against DINOv3's formula written out here, and the step's
use of the ramped weight."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_gram import _equal, _gram_crops, _params, tiny


def test_snapshot_then_refreshes_on_schedule():
    """DINOv3's rule: refreshes before the steps that are multiples of refresh_every after the start (here 4
    and 8, where counting from the start step would give 7 and 11), once per step, at most max_refreshes."""
    model = tiny(gram_loss_weight=2.0, gram_start_step=3, gram_refresh_every=4, gram_max_refreshes=2)
    gram, teacher = model.gram_teacher, model.teacher.backbone

    def nudge():  # the EMA teacher moves between steps
        with torch.no_grad():
            for p in teacher.parameters():
                p.add_(0.01)

    nudge()
    gram.update(teacher, 2)
    assert not gram.initialised and gram.weight_at(2) == 0.0
    assert not _equal(_params(gram.backbone), _params(teacher))
    gram.update(teacher, 3)  # the snapshot
    snapshot = _params(gram.backbone)
    assert gram.initialised and gram.weight_at(3) == 2.0 and _equal(snapshot, _params(teacher))
    assert gram.refreshes == 0
    nudge()
    gram.update(teacher, 4)  # (it + 1) = 4 is a multiple of 4: the first refresh
    assert gram.refreshes == 1 and _equal(_params(gram.backbone), _params(teacher))
    refreshed = _params(gram.backbone)
    nudge()
    for step in (4, 5, 6, 7):  # a micro-batch of the same step, then steps not due
        gram.update(teacher, step)
    assert gram.refreshes == 1 and _equal(_params(gram.backbone), refreshed)
    gram.update(teacher, 8)  # the second refresh
    assert gram.refreshes == 2 and _equal(_params(gram.backbone), _params(teacher))
    nudge()
    gram.update(teacher, 12)  # max_refreshes reached
    assert gram.refreshes == 2 and not _equal(_params(gram.backbone), _params(teacher))
    assert not any(p.requires_grad for p in gram.parameters())


def dinov3_refresh_steps(start, every, max_refreshes, n_iterations):
    """The steps before which DINOv3's training loop has refreshed the Gram teacher, written as its loop runs:
    after iteration ``it``, if ``it + 1 >= it_first_update`` and ``(it + 1) % every == 0`` and fewer than
    ``max_refreshes`` so far; ``it_first_update`` is the step after our start step."""
    done, steps = 0, []
    for it in range(n_iterations):
        if it + 1 >= start + 1 and (it + 1) % every == 0 and done < max_refreshes:
            steps.append(it + 1)
            done += 1
    return steps


@pytest.mark.parametrize("start, every, max_refreshes", [(0, 3, 3), (5, 3, 2), (7, 1, 3)])
def test_refreshes_follow_dinov3s_loop(start, every, max_refreshes):
    model = tiny(
        gram_loss_weight=1.0,
        gram_start_step=start,
        gram_refresh_every=every,
        gram_max_refreshes=max_refreshes,
    )
    gram, ours = model.gram_teacher, []
    for step in range(20):
        before = gram.refreshes
        for _ in range(2):  # two micro-batches of one step
            gram.update(model.teacher.backbone, step)
        if gram.refreshes != before:
            ours.append(step)
    assert ours == dinov3_refresh_steps(start, every, max_refreshes, 19)


def dinov3_gram_weight(value, start, warmup, step):
    """DINOv3's ``linear_warmup_cosine_decay(start=0, peak=0, end=value, warmup_iterations=start,
    cosine_iterations=warmup)`` at ``step``, one entry at a time: a linear part from 0 to 0, then
    ``(peak - end) * (cos(pi * k / (warmup - 1)) + 1) / 2 + end`` (``np.linspace(0, pi, warmup)``), then ``end``."""
    if step < start:
        return 0.0
    k = step - start
    if k >= warmup:
        return value
    angle = math.pi * k / (warmup - 1) if warmup > 1 else 0.0
    return (0.0 - value) * (math.cos(angle) + 1) / 2 + value


def test_the_gram_weight_ramp_is_dinov3s_cosine():
    from ssl_xcit.dino.schedules import dino_schedules, gram_ramp

    for value, start, warmup, total in [
        (2.0, 2, 4, 10),
        (2.0, 1000, 1000, 2200),
        (1.5, 3, 1, 8),
        (2.0, 2, 0, 6),
    ]:
        want = [dinov3_gram_weight(value, start, warmup, i) for i in range(total)]
        np.testing.assert_allclose(gram_ramp(value, start, warmup, total), want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(gram_ramp(2.0, 2, 4, 8), [0, 0, 0, 0.5, 1.5, 2, 2, 2], atol=1e-12)  # by hand
    assert gram_ramp(0.0, 2, 4, 10) is None
    late = gram_ramp(1.0, 9, 3, 10)  # starts after the planned run: still ramps, then holds the weight
    np.testing.assert_allclose(late, [0] * 9 + [0, 0.5, 1, 1], atol=1e-12)
    hp = {**tiny(gram_loss_weight=2.0).hparams, "gram_start_step": 1, "gram_weight_warmup_steps": 3}
    s = dino_schedules(hp, epochs=2, batches=3, per_device_batch=4, world_size=1)
    assert [s.gram_weight_at(i) for i in range(8)] == pytest.approx([0, 0, 1, 2, 2, 2, 2, 2], abs=1e-12)
    assert dino_schedules(tiny().hparams, 2, 3, 4, 1).gram_weight_at(5) == 0.0


def test_the_step_uses_the_ramped_weight():
    from ssl_xcit.dino.schedules import dino_schedules

    torch.manual_seed(0)
    model = tiny(drop_path_rate=0.0, gram_loss_weight=2.0, gram_start_step=1, gram_weight_warmup_steps=4)
    model.schedules = dino_schedules(model.hparams, epochs=1, batches=8, per_device_batch=2, world_size=1)
    crops = [torch.randn(2, 3, s, s) for s in (32, 32, 16, 16)]
    gram_crops = _gram_crops(crops, 1)
    model._update_gram_teacher(1)  # the snapshot, at weight 0: no term yet
    assert model.gram_teacher.initialised and model.gram_weight_now == 0.0
    assert model.compute_losses(crops, None, 0, update_center=False, gram_crops=gram_crops).gram is None
    off = model.compute_losses(crops, None, 0, update_center=False, gram_crops=gram_crops)
    model._update_gram_teacher(3)
    assert model.gram_weight_now == pytest.approx(1.5)  # 2.0 * (1 - cos(pi * 2 / 3)) / 2
    on = model.compute_losses(crops, None, 0, update_center=False, gram_crops=gram_crops)
    assert float(on.gram) > 0
    torch.testing.assert_close(on.total, off.total + 1.5 * on.gram)
