"""DINO refuses the "true" half precisions (its teacher's EMA would round away) before any step."""

from __future__ import annotations

import pytest

from ssl_xcit.dino.precision import check_precision
from ssl_xcit.errors import UserError


@pytest.mark.parametrize("precision,mixed", [("bf16-true", "bf16-mixed"), ("16-true", "16-mixed")])
def test_true_half_precision_is_refused_before_training(tiny, tmp_path, precision, mixed):
    trainer = tiny.trainer(tmp_path, max_epochs=1, precision=precision, limit_train_batches=1)
    message = f"precision '{precision}' keeps DINO's teacher in .*use --trainer.precision {mixed}"
    with pytest.raises(UserError, match=message):
        trainer.fit(tiny.model(), tiny.loader(n=4))
    assert trainer.global_step == 0


@pytest.mark.parametrize("precision", ["32-true", "64-true", "bf16-mixed", "16-mixed"])
def test_full_and_mixed_precisions_are_accepted(precision):
    check_precision(precision)  # raises nothing
