"""The per-family recipes parse with the CLI and run a few DINO steps on CPU (tiny overrides)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ssl_xcit.cli.train import main

REPO = Path(__file__).resolve().parents[2]
# recipe -> (backbone, tiny backbone_kwargs, global crop, local crop); CrossFormer++ takes multiples of 32.
FAMILY_RECIPES = {
    "dino_cait_xxs24.yaml": ("cait_xxs24", "{depth: 1}", 32, 16),
    "dino_vit_s16.yaml": ("vit_small_patch16_224", "{depth: 1}", 32, 16),
    "dino_crossformerpp_s.yaml": ("crossformerpp_small", "{depths: [1, 1, 1, 1]}", 64, 32),
    "dino_bixt_ti16.yaml": ("bixt_ti_l64_p16", "{depth: 2}", 32, 16),
}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("family_images")
    rng = np.random.default_rng(0)
    for c in range(2):
        folder = root / f"class{c}"
        folder.mkdir()
        for i in range(8):
            Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(folder / f"{i}.jpg")
    return root


@pytest.mark.parametrize("recipe", FAMILY_RECIPES)
def test_family_recipe_runs_a_few_steps(recipe, images, tmp_path, monkeypatch):
    backbone, kwargs, global_size, local_size = FAMILY_RECIPES[recipe]
    monkeypatch.chdir(tmp_path)  # the recipe's runs/ directories land here
    args = [
        "fit", "-c", str(REPO / "recipes" / recipe),
        f"--data.init_args.root={images}",
        f"--model.init_args.backbone_kwargs={kwargs}",
        "--model.init_args.out_dim=64", "--model.init_args.head_hidden_dim=32",
        "--model.init_args.head_bottleneck_dim=16",
        "--model.init_args.warmup_epochs=0", "--model.init_args.warmup_teacher_temp_epochs=0",
        "--data.init_args.batch_size=4", "--data.init_args.num_workers=0",
        "--data.init_args.persistent_workers=false", "--data.init_args.pin_memory=false",
        f"--data.init_args.global_crops_size={global_size}", f"--data.init_args.local_crops_size={local_size}",
        "--data.init_args.local_crops_number=2",
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1",
        "--trainer.strategy=auto", "--trainer.precision=32", "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=2", "--trainer.logger=false", "--trainer.benchmark=false",
    ]  # fmt: skip
    cli = main(args)
    model = cli.model
    assert model.hparams.backbone == backbone and model.teacher.backbone.name == backbone
    assert cli.trainer.global_step == 2
    assert np.isfinite(float(cli.trainer.callback_metrics["train/loss"]))
