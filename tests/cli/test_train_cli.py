"""`ssl-xcit fit/validate` (LightningCLI) and `ssl-xcit export`, run in-process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssl_xcit.cli.export import main as export_main
from ssl_xcit.cli.train import SSLXCiTCLI, main

from .conftest import TINY_ARGS, tiny_config  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_every_recipe_parses(recipe, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(recipe), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    module = "ssl_xcit.dino.distill.Distill" if recipe.name == "distill.yaml" else "ssl_xcit.dino.module.DINO"
    assert module in printed and "DINODataModule" in printed


def test_s12_8_recipe_builds_the_published_model(tmp_path):
    cli = SSLXCiTCLI(
        __import__("lightning").pytorch.LightningModule,
        __import__("lightning").pytorch.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=[
            "-c", str(REPO / "recipes" / "dino_xcit_s12_8.yaml"),
            f"--data.init_args.root={tmp_path}",
            # this machine has no GPU cluster: only the Trainer's hardware is overridden
            "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1",
            "--trainer.strategy=auto", "--trainer.precision=32", "--trainer.logger=false",
            f"--run_dir={tmp_path / 'run'}",  # not a version folder in the repo's runs/
        ],
    )  # fmt: skip
    model = cli.model
    backbone = model.teacher.backbone
    assert type(model).__name__ == "DINO" and model.hparams.backbone == "xcit_small_12_p8"
    assert (backbone.patch_size, backbone.embed_dim, backbone.depth) == (8, 384, 12)
    assert model.student.head.last_layer.weight_v.shape == (65536, 256)
    assert model.student.head.last_layer.weight_g.requires_grad  # norm_last_layer: false
    assert model.hparams.drop_path_rate == 0.05 and model.hparams.teacher_temp == 0.07
    assert model.hparams.warmup_teacher_temp_epochs == 30 and cli.trainer.max_epochs == 300
    assert cli.datamodule.hparams.global_crops_scale == (0.3, 1.0) or list(
        cli.datamodule.hparams.global_crops_scale
    ) == [0.3, 1.0]
    # VISSL's XCiT-DINO colour distortion (strength 0.5): saturation 0.4, not DINO-ViT's 0.2
    assert list(cli.datamodule.hparams.color_jitter) == [0.4, 0.4, 0.4, 0.1]


def test_config_typo_is_named(tmp_path, image_folder, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *tiny_config(tmp_path, image_folder), "--model.init_args.teacher_tmp=0.04"])
    assert exit_info.value.code == 2
    assert "teacher_tmp" in capsys.readouterr().err
    bad = tmp_path / "typo.yaml"
    bad.write_text(
        "model:\n  class_path: ssl_xcit.dino.module.DINO\n  init_args:\n    momentum_techer: 0.99\n"
    )
    with pytest.raises(SystemExit):
        main(["fit", "-c", str(bad)])
    assert "momentum_techer" in capsys.readouterr().err


def test_wrong_model_name_and_data_path_are_named(tmp_path, image_folder):
    with pytest.raises(ValueError, match="xcit_bogus_12_p16"):
        main(["fit", *tiny_config(tmp_path, image_folder), "--model.init_args.backbone=xcit_bogus_12_p16"])
    missing = tmp_path / "no_such_folder"
    # jsonargparse re-raises instantiation errors of subclass-mode arguments as ValueError, message kept
    with pytest.raises((FileNotFoundError, ValueError), match="no_such_folder does not exist"):
        main(["fit", *tiny_config(tmp_path, image_folder), f"--data.init_args.root={missing}"])


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, image_folder):
    """One tiny `ssl-xcit fit` run shared by the tests below: (trainer, config args, last.ckpt)."""
    tmp_path = tmp_path_factory.mktemp("fit")
    args = tiny_config(tmp_path, image_folder)
    cli = main(["fit", *args])
    return cli.trainer, args, tmp_path / "runs" / "version_0" / "checkpoints" / "last.ckpt"


def test_fit_writes_checkpoints_and_online_knn(fitted):
    trainer, _, last = fitted
    assert trainer.global_step == 4  # 16 images / batch 4, 1 epoch
    assert last.is_file() and (last.parent / "epoch=0000.ckpt").is_file()
    knn = next(cb for cb in trainer.callbacks if type(cb).__name__ == "OnlineKNN")
    assert [h["step"] for h in knn.history] == [0, 4]  # random init, then after the epoch
    assert 0.0 <= knn.history[-1]["top1"] <= 100.0
    metrics = (last.parent.parent / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    for name in ("train/loss", "train/lr", "train/wd", "train/teacher_momentum", "train/teacher_temp",
                 "train/teacher_entropy", "train/kl_to_uniform", "knn/top1", "knn/k", "knn/temperature"):  # fmt: skip
        assert name in metrics, name


def test_validate_reports_knn_of_a_checkpoint(fitted):
    _, args, last = fitted
    cli = main(["validate", *args, f"--ckpt_path={last}"])
    assert "knn/top1" in cli.trainer.callback_metrics


def test_export_round_trip_into_ours_and_timm(fitted, tmp_path):
    import timm

    from ssl_xcit.models import create_model

    _, _, last = fitted
    out = tmp_path / "teacher.pth"
    result = export_main([str(last), str(out)])
    assert result["model"] == "xcit_nano_12_p8"
    state = torch.load(out, weights_only=True)["state_dict"]
    ours = create_model("xcit_nano_12_p8", depth=1)
    ours.load_state_dict(state, strict=True)
    theirs = timm.create_model("xcit_nano_12_p8_224", pretrained=False, num_classes=0, depth=1)
    theirs.load_state_dict(state, strict=True)
    ckpt = torch.load(last, weights_only=True)["state_dict"]
    assert torch.equal(state["cls_token"], ckpt["teacher.backbone.cls_token"])  # the teacher, not the student
    assert not torch.equal(state["cls_token"], ckpt["student.backbone.cls_token"])
    x = torch.randn(2, 3, 32, 32)
    ours.eval(), theirs.eval()
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-5)


def test_export_errors_are_clear(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        export_main([str(tmp_path / "missing.ckpt"), str(tmp_path / "out.pth")])
    assert exit_info.value.code == 2 and "missing.ckpt does not exist" in capsys.readouterr().err
    no_backbone = tmp_path / "heads_only.ckpt"
    torch.save({"state_dict": {"student.head.w": torch.zeros(1)}, "hyper_parameters": {}}, no_backbone)
    with pytest.raises(SystemExit):
        export_main([str(no_backbone), str(tmp_path / "out.pth")])
    err = capsys.readouterr().err
    assert "no teacher backbone" in err and "student" in err
    # A student-only checkpoint is a distillation run's: its student exports, once its backbone is named.
    student_only = tmp_path / "student_only.ckpt"
    torch.save(
        {"state_dict": {"student.backbone.cls_token": torch.zeros(1)}, "hyper_parameters": {}}, student_only
    )
    with pytest.raises(SystemExit):
        export_main([str(student_only), str(tmp_path / "out.pth")])
    assert "does not record its backbone name" in capsys.readouterr().err
    assert not (tmp_path / "out.pth").exists()


@pytest.mark.parametrize("backbone", ["xcit_nano_12_p8", "vit_tiny_patch16_224", "cait_xxs24"])
def test_fit_with_ibot_for_each_maskable_family(backbone, tmp_path, image_folder):
    """`ssl-xcit fit` with iBOT's patch term; the checkpoint then exports and loads as a plain backbone."""
    from ssl_xcit.models import build_backbone

    args = tiny_config(tmp_path, image_folder) + [
        f"--model.init_args.backbone={backbone}",
        "--model.init_args.ibot_loss_weight=1.0",
        "--data.init_args.global_crops_size=32",
        "--data.init_args.local_crops_size=16",
        "--data.init_args.eval_resize=32",
        "--data.init_args.eval_crop=32",
    ]
    cli = main(["fit", *args])
    assert cli.trainer.global_step == 4
    last = tmp_path / "runs" / "version_0" / "checkpoints" / "last.ckpt"
    metrics = (last.parent.parent / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    for name in ("train/ibot_loss", "train/ibot_teacher_entropy", "train/ibot_kl_to_uniform"):
        assert name in metrics, name
    # The mask token is a training input: evaluation builds the plain backbone from the checkpoint.
    backbone_model = build_backbone(str(last))
    assert getattr(backbone_model, "mask_token", None) is None
    exported = tmp_path / "teacher.pth"
    export_main([str(last), str(exported)])
    torch.testing.assert_close(
        build_backbone(str(exported))(torch.ones(1, 3, 32, 32)), backbone_model(torch.ones(1, 3, 32, 32))
    )
