"""A tiny DINO recipe on a tiny image folder, shared by the CLI tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

# A tiny DINO: 1-block XCiT-N/8, small head, 16/8 px crops; runs in seconds.
TINY_ARGS = [
    "--model.init_args.backbone=xcit_nano_12_p8",
    "--model.init_args.backbone_kwargs={depth: 1}",
    "--model.init_args.out_dim=64",
    "--model.init_args.head_hidden_dim=32",
    "--model.init_args.head_bottleneck_dim=16",
    "--model.init_args.warmup_epochs=0",
    "--model.init_args.warmup_teacher_temp_epochs=0",
    "--data.init_args.batch_size=4",
    "--data.init_args.num_workers=0",
    "--data.init_args.persistent_workers=false",
    "--data.init_args.global_crops_size=16",
    "--data.init_args.local_crops_size=8",
    "--data.init_args.local_crops_number=2",
    "--data.init_args.eval_resize=16",
    "--data.init_args.eval_crop=16",
    "--trainer.max_epochs=1",
    "--trainer.log_every_n_steps=1",
    "--trainer.accelerator=cpu",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    """2 classes x 8 tiny JPEGs (train) and 2 x 3 (val) in ImageFolder layout."""
    root = tmp_path_factory.mktemp("images")
    gen = torch.Generator().manual_seed(0)
    for split, n in (("train", 8), ("val", 3)):
        for c, colour in enumerate(((200, 30, 30), (30, 30, 200))):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(n):
                noise = torch.randint(0, 40, (24, 24, 3), generator=gen).numpy().astype("uint8")
                image = Image.new("RGB", (24, 24), colour)
                Image.fromarray((noise + np.asarray(image) // 2).astype("uint8")).save(folder / f"{i}.jpg")
    return root


def tiny_config(tmp_path: Path, image_folder: Path) -> list[str]:
    """A recipe shaped like ours (no paths but default_root_dir) on the tiny image folder; runs go to
    ``tmp_path/runs/version_N``."""
    config = f"""
seed_everything: 0
trainer:
  default_root_dir: {tmp_path / "runs"}
  logger:
    - class_path: lightning.pytorch.loggers.CSVLogger
      init_args: {{save_dir: ., name: csv}}
  callbacks:
    - class_path: ssl_xcit.trainer.callbacks.OnlineKNN
      init_args: {{k: 3, evaluate_at_start: true}}
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{filename: "{{epoch:04d}}", every_n_epochs: 1, save_top_k: -1, save_last: true}}
model:
  class_path: ssl_xcit.dino.module.DINO
data:
  class_path: ssl_xcit.data.DINODataModule
  init_args:
    root: {image_folder / "train"}
    val_root: {image_folder / "val"}
"""
    path = tmp_path / "tiny.yaml"
    path.write_text(config)
    return ["-c", str(path), *TINY_ARGS]
