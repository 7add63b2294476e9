"""``recipes/continue_dinov3.yaml`` parses and runs at tiny size on unlabelled photos: both heads start fresh and
warm up with the backbone held, the Gram teacher is the source itself, the last epoch is the high-resolution
stage, and RankMe is logged without labels. The recipe's DINOv3 ViT-S/16 is cut to one block, and its source (timm's
copy of Meta's weights, which this machine cannot download) is a file of that cut model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from ssl_xcit.cli.train import main
from ssl_xcit.data.datamodule import DINODataModule
from ssl_xcit.dino.module import DINO
from ssl_xcit.models import create_model
from ssl_xcit.models.export import save_safetensors
from ssl_xcit.trainer.rankme import RankMe

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "continue_dinov3.yaml"


def test_the_recipe_asks_for_what_dinov3_would_do_and_builds(image_folder):
    recipe = yaml.safe_load(RECIPE.read_text())
    model, data = recipe["model"]["init_args"], recipe["data"]["init_args"]
    assert model["init_from"].startswith("timm:") and model["init_head_warmup_steps"] is None
    assert model["gram_teacher"] == "init_from" and model["gram_loss_weight"] > 0
    assert model["ibot_loss_weight"] > 0 and model["ibot_separate_head"]
    assert data["high_res_epochs"] > 0 and data["val_fraction"] > 0
    assert "ssl_xcit.trainer.rankme.RankMe" in [c["class_path"] for c in recipe["trainer"]["callbacks"]]
    # Every setting is one the classes take (the source is read when a fit starts: no download here).
    built = DINO(**{**model, "backbone_kwargs": {"depth": 1}})
    assert built.gram_teacher is not None and built.ibot
    dm = DINODataModule(**{**data, "root": str(image_folder / "train")})
    assert dm.high_res.sizes == ((448, 192),)  # one (global, local) pair


@pytest.mark.slow
def test_continue_recipe_runs_on_unlabelled_photos(tmp_path, image_folder):
    torch.manual_seed(0)
    source = create_model("vit_small_patch16_dinov3", depth=1)
    save_safetensors(
        source.state_dict(), "vit_small_patch16_dinov3", {"depth": 1}, tmp_path / "source.safetensors"
    )
    cli = main([
        "fit", "-c", str(RECIPE), f"--data.root={image_folder / 'train'}", f"--run_dir={tmp_path / 'run'}",
        "--model.backbone_kwargs={depth: 1}",
        f"--model.init_from={tmp_path / 'source.safetensors'}", "--model.out_dim=64", "--model.ibot_out_dim=64",
        "--model.head_hidden_dim=32", "--model.head_bottleneck_dim=16", "--model.warmup_epochs=0",
        "--data.labelled=false", "--data.val_fraction=0.25", "--data.batch_size=4", "--data.num_workers=0",
        "--data.persistent_workers=false", "--data.local_crops_number=2", "--data.global_crops_size=32",
        "--data.local_crops_size=16", "--data.eval_resize=32", "--data.eval_crop=32",
        "--data.high_res_epochs=1", "--data.high_res_crops_size=[64, 32]", "--trainer.max_epochs=2",
        "--trainer.accelerator=cpu", "--trainer.precision=32",
    ])  # fmt: skip
    model, trainer = cli.model, cli.trainer
    assert trainer.global_step == 6 and cli.datamodule.stage == "high_res"  # 12 training photos, 4 held out
    # Both heads were fresh: 50 head-only steps, so the backbone is still the source's.
    assert model.init_state["head_warmup_steps"] == 50
    want = source.state_dict()
    for key, value in model.student.backbone.named_parameters():
        if key != "mask_token":
            assert torch.equal(value, want[key]), key
    for key, value in model.gram_teacher.backbone.state_dict().items():
        assert torch.equal(value, want[key]), key  # anchored to the source itself
    monitor = next(cb for cb in trainer.callbacks if isinstance(cb, RankMe))
    assert [h["step"] for h in monitor.history] == [0, 3, 6]
    assert all(1.0 <= h["embedding"] <= 4 and h["patch"] >= 1.0 for h in monitor.history)  # 4 images
