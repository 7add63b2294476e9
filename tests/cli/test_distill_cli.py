"""``ssl-xcit fit -c recipes/distill.yaml --model.teacher SOURCE`` at tiny size: the dino objective from a DINO
checkpoint of ours, resumed with ``--ckpt_path last`` (the teacher read again from SOURCE), then ``export`` and
``knn`` of the distillation checkpoint take the student; a bad teacher ends the command in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssl_xcit.cli import console_main
from ssl_xcit.cli import main as cli_main
from ssl_xcit.cli.errors import HINT
from ssl_xcit.cli.train import main
from ssl_xcit.dino.module import DINO
from ssl_xcit.models.export import read_safetensors

DISTILL = str(Path(__file__).resolve().parents[2] / "recipes" / "distill.yaml")
SMALL = ["--model.backbone=xcit_nano_12_p8", "--model.backbone_kwargs={depth: 1}", "--model.head_hidden_dim=32",
         "--model.head_bottleneck_dim=16", "--model.warmup_epochs=0", "--data.batch_size=4",
         "--data.num_workers=0", "--data.persistent_workers=false", "--data.local_crops_number=2",
         "--data.global_crops_size=32", "--data.local_crops_size=16", "--data.eval_resize=32",
         "--data.eval_crop=32", "--trainer.limit_train_batches=2", "--trainer.accelerator=cpu",
         "--trainer.precision=32"]  # fmt: skip


def _distill(tmp_path: Path, image_folder: Path, teacher: str, epochs: int = 1) -> list[str]:
    return ["fit", "-c", DISTILL, f"--data.root={image_folder}", f"--run_dir={tmp_path / 'run'}",
            "--model.teacher", teacher, "--model.objective=dino", f"--trainer.max_epochs={epochs}", *SMALL]  # fmt: skip


def test_dino_objective_resumes_and_its_checkpoint_exports_the_student(tmp_path, image_folder, capsys):
    torch.manual_seed(0)
    dino = DINO("vit_tiny_patch16_224", backbone_kwargs={"depth": 1}, out_dim=64, head_hidden_dim=32,
                head_bottleneck_dim=16)  # fmt: skip
    teacher = tmp_path / "teacher.ckpt"
    torch.save({"state_dict": dino.state_dict(), "hyper_parameters": dict(dino.hparams)}, teacher)
    cli = main(_distill(tmp_path, image_folder, str(teacher)))
    assert cli.trainer.global_step == 2 and type(cli.model).__name__ == "Distill"
    resumed = main([*_distill(tmp_path, image_folder, str(teacher), epochs=2), "--ckpt_path", "last"])
    assert resumed.trainer.global_step == 4
    for key, value in dino.teacher.backbone.state_dict().items():  # read again from SOURCE, never trained
        assert torch.equal(resumed.model.teacher.backbone.state_dict()[key], value), key
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    cli_main(["export", str(ckpt), str(tmp_path / "student.safetensors")])
    exported = read_safetensors(tmp_path / "student.safetensors")
    assert exported["hyper_parameters"]["backbone"] == "xcit_nano_12_p8"
    student = resumed.model.student.backbone.state_dict()
    assert all(torch.equal(v, student[k]) for k, v in exported["state_dict"].items())
    capsys.readouterr()
    cli_main(["knn", "--weights", str(ckpt), "--train", str(image_folder), "--val", str(image_folder),
              "--batch-size", "8", "--num-workers", "0", "--resize-size", "32", "--crop-size", "32"])  # fmt: skip
    assert (
        "   20 " in capsys.readouterr().out
    )  # the k-NN table (its reader is the one build_backbone tests check)


def test_a_bad_teacher_ends_the_fit_in_one_line(tmp_path, image_folder, capsys):
    # One case through the command line; the other bad teachers are tested in tests/dino/test_distill.py.
    with pytest.raises(SystemExit) as exit_info:
        console_main(_distill(tmp_path, image_folder, "timm:vit_tiny_patch16_2244"))
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert (
        len(lines) == 2 and lines[-1] == HINT and "timm has no model 'vit_tiny_patch16_2244'" in lines[0]
    ), lines
