"""``ssl-xcit fit -c recipes/quickstart.yaml --model.init_from SOURCE`` at tiny size: the run starts from SOURCE
(its backbone held through the head-only warm-up), and a bad SOURCE ends the command in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssl_xcit.cli import console_main
from ssl_xcit.cli.errors import HINT
from ssl_xcit.cli.train import main
from ssl_xcit.dino.module import DINO
from ssl_xcit.models.export import save_safetensors

QUICKSTART = str(Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml")
# The quickstart's structure at seconds' size (tests/test_readme.py shrinks it the same way).
SMALL = ["--model.backbone_kwargs={depth: 1}", "--model.out_dim=64", "--model.head_hidden_dim=32",
         "--model.head_bottleneck_dim=16", "--model.warmup_epochs=0", "--model.warmup_teacher_temp_epochs=0",
         "--data.batch_size=4", "--data.num_workers=0", "--data.persistent_workers=false",
         "--data.local_crops_number=2", "--data.global_crops_size=16", "--data.local_crops_size=8",
         "--data.eval_resize=16", "--data.eval_crop=16", "--trainer.max_epochs=1",
         "--trainer.limit_train_batches=2", "--trainer.accelerator=cpu", "--trainer.precision=32"]  # fmt: skip


def _quickstart(tmp_path: Path, image_folder: Path, source: str) -> list[str]:
    return ["fit", "-c", QUICKSTART, f"--data.root={image_folder}", f"--run_dir={tmp_path / 'run'}",
            "--model.init_from", source, *SMALL]  # fmt: skip


def test_quickstart_starts_from_an_export(tmp_path, image_folder):
    torch.manual_seed(0)
    pretrained = DINO(backbone="xcit_nano_12_p8", backbone_kwargs={"depth": 1}, out_dim=64).teacher.backbone
    save_safetensors(
        pretrained.state_dict(), "xcit_nano_12_p8", {"depth": 1}, tmp_path / "teacher.safetensors"
    )
    argv = _quickstart(tmp_path, image_folder, str(tmp_path / "teacher.safetensors"))
    cli = main([*argv, "--model.init_head_warmup_steps=2"])
    assert cli.trainer.global_step == 2
    want = dict(pretrained.named_parameters())
    # Two head-only steps: the student's backbone is the export's; the teacher's too, up to the EMA's rounding
    # (m * w + (1 - m) * w is not w in floating point).
    for side, tolerance in (("student", 0.0), ("teacher", 1e-6)):
        for key, value in getattr(cli.model, side).backbone.named_parameters():
            torch.testing.assert_close(value, want[key], rtol=0, atol=tolerance, msg=f"{side} {key}")


def test_a_bad_source_ends_the_fit_in_one_line(tmp_path, image_folder, capsys):
    # One case through the command line; every other bad source is tested in tests/dino/test_init_from.py.
    with pytest.raises(SystemExit) as exit_info:
        console_main(_quickstart(tmp_path, image_folder, str(tmp_path / "missing.safetensors")))
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[-1] == HINT and "missing.safetensors: file not found" in lines[0], lines
