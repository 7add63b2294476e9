from __future__ import annotations

import math

import numpy as np
import pytest

from ssl_xcit.dino.schedules import cosine_schedule, scaled_lr, teacher_temperature


def test_cosine_schedule_exact_values_of_the_reference():
    # 100 epochs x 10 iterations, base 0.002, min 1e-6, 10 warm-up epochs (reference behaviour, dino_xcit.md 2.5)
    lr = cosine_schedule(0.002, 1e-6, epochs=100, iters_per_epoch=10, warmup_epochs=10)
    assert lr.shape == (1000,)
    assert lr[0] == 0.0
    assert lr[99] == pytest.approx(0.002, abs=0, rel=1e-15)  # last warm-up iteration = base
    assert lr[100] == pytest.approx(0.002, rel=1e-15)  # first cosine iteration = base again
    assert lr[50] == pytest.approx(0.002 * 50 / 99, rel=1e-12)  # linspace(0, base, 100)
    # last value: final + 0.5 (base - final)(1 + cos(pi * 899 / 900))
    expected_last = 1e-6 + 0.5 * (0.002 - 1e-6) * (1 + math.cos(math.pi * 899 / 900))
    assert lr[-1] == pytest.approx(expected_last, rel=1e-12)
    assert lr[-1] == pytest.approx(1.006e-6, abs=1e-9)
    assert np.all(np.diff(lr[100:]) <= 0)


def test_cosine_schedule_without_warmup_and_increasing():
    wd = cosine_schedule(0.04, 0.4, epochs=3, iters_per_epoch=4)
    assert wd[0] == pytest.approx(0.04)
    assert np.all(np.diff(wd) > 0)
    assert wd[6] == pytest.approx(0.04 + 0.5 * (0.4 - 0.04) * (1 - math.cos(math.pi * 6 / 12)))
    momentum = cosine_schedule(0.996, 1.0, epochs=100, iters_per_epoch=10)
    assert momentum[0] == 0.996 and momentum[500] == pytest.approx(0.998) and 0.99999 < momentum[-1] < 1.0


def test_cosine_schedule_rejects_bad_lengths():
    with pytest.raises(ValueError, match="warmup_epochs"):
        cosine_schedule(1.0, 0.0, epochs=2, iters_per_epoch=3, warmup_epochs=3)
    with pytest.raises(ValueError, match="iters_per_epoch"):
        cosine_schedule(1.0, 0.0, epochs=2, iters_per_epoch=0)


def test_teacher_temperature_warmup_per_epoch():
    assert teacher_temperature(0, 0.04, 0.07, 30) == pytest.approx(0.04)
    assert teacher_temperature(1, 0.04, 0.07, 30) == pytest.approx(0.04 + 0.03 / 29)
    assert teacher_temperature(29, 0.04, 0.07, 30) == pytest.approx(0.07)
    assert teacher_temperature(250, 0.04, 0.07, 30) == 0.07
    assert teacher_temperature(0, 0.04, 0.04, 0) == 0.04


def test_lr_scaling_rule():
    assert scaled_lr(0.0005, 1024) == pytest.approx(0.002)
    assert scaled_lr(0.0005, 64) == pytest.approx(0.000125)
