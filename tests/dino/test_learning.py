"""DINO learns on real photos: one epoch on flowers5 beats the same backbone at random initialisation."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from ssl_xcit.data.datamodule import DINODataModule
from ssl_xcit.data.datasets import collate_skip_none
from ssl_xcit.dino.module import DINO
from ssl_xcit.evaluation.knn import knn_accuracy


@torch.no_grad()
def _knn_top1(backbone: torch.nn.Module, bank_ds, query_ds) -> float:
    backbone.eval()

    def extract(dataset):
        loader = torch.utils.data.DataLoader(dataset, batch_size=128, collate_fn=collate_skip_none)
        feats, labels = zip(*((backbone(x), y) for x, y, _ in loader), strict=True)
        return torch.cat(feats), torch.cat(labels)

    bank, bank_y = extract(bank_ds)
    query, query_y = extract(query_ds)
    return knn_accuracy(bank, bank_y, query, query_y, ks=(20,))[20]["top1"]


@pytest.mark.slow
def test_one_epoch_of_dino_beats_random_init_on_flowers(shared_data, tmp_path):
    dm = DINODataModule(
        root=str(shared_data / "flowers5"),
        val_fraction=0.2,
        batch_size=32,
        num_workers=0,
        global_crops_size=64,
        local_crops_number=4,
        local_crops_size=32,
        local_crops_scale=(0.1, 0.4),
        eval_resize=64,
        eval_crop=64,
    )
    dm.setup("fit")
    bank_ds, query_ds = dm.knn_datasets()
    L.seed_everything(0, verbose=False)
    model = DINO(
        backbone="xcit_nano_12_p16",
        backbone_kwargs={"depth": 4},
        out_dim=1024,
        use_bn_in_head=True,
        warmup_teacher_temp=0.02,
        teacher_temp=0.04,
        momentum_teacher=0.99,
        lr=0.004,
        min_lr=1e-5,
        warmup_epochs=0,
        weight_decay_end=0.1,
    )
    random_init = _knn_top1(model.teacher.backbone, bank_ds, query_ds)
    trainer = L.Trainer(
        max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, dm)
    learned = _knn_top1(model.teacher.backbone, bank_ds, query_ds)
    # 864 held-out queries: a 3-point gain is ~2 standard errors above random init (measured: +4 to +5).
    assert learned >= random_init + 3.0, (learned, random_init)
