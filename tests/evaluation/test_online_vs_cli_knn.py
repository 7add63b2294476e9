"""The online k-NN monitor and `ssl-xcit knn` agree on the same checkpoint, images and transform (issue 8)."""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning as L
import pytest

from ssl_xcit.cli.knn import main as knn_main
from ssl_xcit.data.datamodule import DINODataModule
from ssl_xcit.dino.module import DINO
from ssl_xcit.trainer.callbacks import OnlineKNN


@pytest.fixture
def flowers_subset(shared_data, tmp_path_factory) -> Path:
    """3 flowers5 classes x (10 train + 4 val) real photos in ImageFolder layout."""
    source = shared_data / "flowers5"
    root = tmp_path_factory.mktemp("flowers_subset")
    for name in ("daisy", "rose", "tulip"):
        files = sorted((source / name).iterdir())[:14]
        for split, chunk in (("train", files[:10]), ("val", files[10:])):
            (root / split / name).mkdir(parents=True)
            for f in chunk:
                shutil.copy(f, root / split / name / f.name)
    return root


def test_online_knn_equals_cli_knn(flowers_subset, tmp_path):
    L.seed_everything(0, verbose=False)
    dm = DINODataModule(
        root=str(flowers_subset / "train"),
        val_root=str(flowers_subset / "val"),
        batch_size=6,
        num_workers=0,
        persistent_workers=False,
        global_crops_size=32,
        local_crops_size=16,
        local_crops_number=2,
        eval_resize=40,
        eval_crop=32,
    )
    model = DINO(
        "xcit_nano_12_p16",
        backbone_kwargs={"depth": 2},
        out_dim=64,
        head_hidden_dim=32,
        head_bottleneck_dim=16,
        warmup_epochs=0,
        lr=0.01,
    )
    knn = OnlineKNN(k=5, temperature=0.07, evaluate_at_start=False)
    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[knn],
    )
    trainer.fit(model, dm)
    ckpt = tmp_path / "model.ckpt"
    trainer.save_checkpoint(ckpt)
    online = knn.history[-1]["top1"]

    result = knn_main([
        "--weights", str(ckpt), "--train", str(flowers_subset / "train"), "--val", str(flowers_subset / "val"),
        "--resize-size", "40", "--crop-size", "32", "--k", "5", "--temperature", "0.07", "--no-cache",
        "--num-workers", "0", "--accelerator", "cpu", "--devices", "1", "--no-progress",
    ])  # fmt: skip
    cli = result["results"]["5"]["top1"]
    assert cli == pytest.approx(online, abs=1e-6)
    assert trainer.global_step == 5  # the checkpoint is a trained one, not the initial weights
