"""Fits with Gram anchoring on through ``DINODataModule``, on both loader paths: the datamodule reads the
model's ``gram_crops_scale`` at setup, and the Gram teacher sees its own crops at twice the global side."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from ssl_xcit.data.datamodule import DINODataModule


@pytest.mark.parametrize("augment_on", ["cpu", "device"])
def test_a_fit_with_gram_anchoring_feeds_the_gram_teacher_its_own_crops(tiny, tmp_path, augment_on):
    rng = np.random.default_rng(0)
    (tmp_path / "data").mkdir()
    for i in range(8):
        Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(
            tmp_path / "data" / f"{i}.jpg"
        )
    dm = DINODataModule(
        root=str(tmp_path / "data"), batch_size=4, num_workers=0, global_crops_size=16, local_crops_size=8,
        local_crops_number=2, augment_on=augment_on,
    )  # fmt: skip
    model = tiny.model(gram_loss_weight=1.0, gram_resolution_scale=2, gram_start_step=1)
    seen = []
    loss = model.gram_teacher.loss

    def record(gram_crops, student_patches, grid):
        seen.append((tuple(gram_crops.shape), gram_crops.dtype, tuple(student_patches.shape), grid))
        return loss(gram_crops, student_patches, grid)

    model.gram_teacher.loss = record
    trainer = tiny.trainer(tmp_path, max_epochs=1)
    trainer.fit(model, dm)
    # 2 steps; the term from step 1 on: one Gram teacher pass on 2 x 4 crops of 32 px, whose 4 x 4 patch grids
    # are resized to the student's 2 x 2.
    assert seen == [((8, 3, 32, 32), torch.float32, (8, 4, 128), (2, 2))]
    assert dm.cpu_transform.gram_crops_size == dm.geometry.gram_crops_size == 32
    assert torch.isfinite(trainer.callback_metrics["train/gram_loss"])
    assert model.gram_teacher.initialised


def test_a_model_that_anchors_refuses_a_loader_without_its_crops(tiny, tmp_path):
    from ssl_xcit.errors import UserError

    model = tiny.model(gram_loss_weight=1.0)
    with pytest.raises(UserError, match="needs 2 Gram teacher crops of shape .* got none") as err:
        tiny.trainer(tmp_path, max_epochs=1).fit(model, tiny.loader(n=8, batch_size=4))
    assert "\n" not in str(err.value)
