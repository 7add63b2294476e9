"""The high-resolution stage (``ssl_xcit.data.stages``): the last epochs of a fit crop at the stage's sizes, a run
resumed mid-stage crops at them from its first batch, and bad settings are one-line errors."""

from __future__ import annotations

import lightning as L
import pytest

from ssl_xcit.data.datamodule import DINODataModule
from ssl_xcit.data.stages import in_high_res_stage
from ssl_xcit.dino.module import DINO
from ssl_xcit.errors import UserError

from .shard_helpers import make_shards
from .test_datamodule import make_tree

TINY = dict(backbone="xcit_nano_12_p8", backbone_kwargs={"depth": 1}, out_dim=32, head_hidden_dim=16,
            head_bottleneck_dim=8, warmup_epochs=0, sync_every_n_steps=1)  # fmt: skip


class CropSizes(L.Callback):
    """(epoch, step, global side, local side) of every training batch."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        crops = batch[0]
        self.seen.append(
            (trainer.current_epoch, trainer.global_step, crops[0].shape[-1], crops[-1].shape[-1])
        )


def _data(root, **overrides) -> DINODataModule:
    return DINODataModule(
        root=str(root), batch_size=4, num_workers=0, persistent_workers=False, global_crops_size=16,
        local_crops_size=8, local_crops_number=1, high_res_epochs=1, high_res_crops_size=(32, 16), **overrides,
    )  # fmt: skip


def _trainer(tmp_path, callbacks, max_epochs=3) -> L.Trainer:
    return L.Trainer(
        max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path, callbacks=callbacks,
        limit_val_batches=0,
    )  # fmt: skip


@pytest.mark.parametrize("source", ["folder", "prepared"])
def test_the_last_epochs_crop_larger_and_a_mid_stage_resume_keeps_the_stage(tmp_path, source):
    # 8 images: 2 steps an epoch. A prepared dataset (LitData shards) was refused with a stage until it took the
    # stage's transform (its records go through `item_transform`, not LitData's `transform`).
    if source == "folder":
        root = make_tree(tmp_path / "data", per_class=4, size=40)
    else:
        root = make_shards(tmp_path / "data", 8, chunk_size=4)
    sizes = CropSizes()
    every_step = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}"
    )
    L.seed_everything(0)
    _trainer(tmp_path, [sizes, every_step]).fit(DINO(**TINY), datamodule=_data(root))
    assert [s[2:] for s in sizes.seen] == [(16, 8)] * 4 + [(32, 16)] * 2  # epochs 0, 1 base; epoch 2 high-res

    # Resume from step 5, the middle of the stage's epoch: its last batch still crops at the stage's sizes.
    resumed = CropSizes()
    L.seed_everything(0)
    _trainer(tmp_path, [resumed]).fit(
        DINO(**TINY), datamodule=_data(root), ckpt_path=str(tmp_path / "ckpt" / "step=5.ckpt")
    )
    assert resumed.seen == [(2, 5, 32, 16)]


class GramCropSizes(L.Callback):
    """(global side, Gram teacher crop side) of every training batch."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        crops = batch[0]
        self.seen.append((crops["crops"][0].shape[-1], crops["gram_crops"][0].shape[-1]))


@pytest.mark.parametrize("scale", [1, 2])
def test_the_gram_teacher_gets_its_crops_in_the_high_res_stage_too(tmp_path, scale):
    # The stage's loader used to cut no Gram crops: a continued run that anchors (continue_dinov3.yaml) ended
    # with "Gram anchoring needs 2 Gram teacher crops ... got none" when its last epochs began.
    root = make_tree(tmp_path / "data", per_class=4, size=40)
    sizes = GramCropSizes()
    model = DINO(**TINY, gram_loss_weight=1.0, gram_start_step=0, gram_resolution_scale=scale)
    L.seed_everything(0)
    _trainer(tmp_path, [sizes], max_epochs=2).fit(model, datamodule=_data(root))
    assert sizes.seen == [(16, 16 * scale)] * 2 + [(32, 32 * scale)] * 2


def test_bad_high_res_settings_are_one_line():
    for epochs, sizes, match in [
        (-1, None, "high_res_epochs must be an integer >= 0"),
        (2, None, r"high_res_epochs=2 needs high_res_crops_size: \[GLOBAL, LOCAL\]"),
        (2, (448,), "needs high_res_crops_size"),
    ]:
        with pytest.raises(UserError, match=match):
            DINODataModule(high_res_epochs=epochs, high_res_crops_size=sizes)
    with pytest.raises(UserError, match=r"high_res_epochs=5 must be fewer than trainer.max_epochs=5"):
        in_high_res_stage(0, 5, 5)
    with pytest.raises(UserError, match="set trainer.max_epochs"):
        in_high_res_stage(0, -1, 1)
    assert [in_high_res_stage(e, 10, 3) for e in range(10)] == [False] * 7 + [True] * 3
