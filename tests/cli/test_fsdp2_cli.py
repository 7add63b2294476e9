"""``ssl-xcit fit -c recipes/quickstart.yaml --trainer.strategy fsdp2 --trainer.devices 2`` (docs/scaling.md) on 2 CPU
processes (gloo; Lightning launches the second), shrunk as tests/test_readme.py shrinks the quickstart; then
the sharded ``last.ckpt`` resumes with ``--ckpt_path last`` and ``ssl-xcit export`` reads it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ssl_xcit.models.sharded import is_sharded_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SHRINK = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
          "--trainer.accelerator=cpu", "--trainer.num_nodes=1", "--trainer.precision=32",
          "--model.init_args.out_dim=64", "--model.init_args.head_hidden_dim=32",
          "--model.init_args.head_bottleneck_dim=16", "--model.init_args.warmup_epochs=0",
          "--model.init_args.warmup_teacher_temp_epochs=0", "--model.init_args.backbone_kwargs={depth: 1}",
          "--data.init_args.batch_size=4", "--data.init_args.num_workers=0",
          "--data.init_args.persistent_workers=false", "--data.init_args.local_crops_number=2",
          "--data.init_args.global_crops_size=32", "--data.init_args.local_crops_size=16",
          "--data.init_args.eval_resize=32", "--data.init_args.eval_crop=32"]  # fmt: skip


def _cli(tmp_path: Path, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "ssl_xcit", *args]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_the_quickstart_trains_resumes_and_exports_under_fsdp2(tmp_path):
    shutil_recipes = tmp_path / "recipes"
    shutil_recipes.mkdir()
    (shutil_recipes / "quickstart.yaml").write_text((ROOT / "recipes" / "quickstart.yaml").read_text())
    fsdp2 = ["--trainer.strategy", "fsdp2", "--trainer.devices", "2"]
    _cli(tmp_path, "fit", "-c", "recipes/quickstart.yaml", *fsdp2, *SHRINK)
    last = tmp_path / "runs" / "quickstart" / "version_0" / "checkpoints" / "last.ckpt"
    assert is_sharded_checkpoint(last)
    _cli(
        tmp_path,
        "fit",
        "-c",
        "recipes/quickstart.yaml",
        *fsdp2,
        *SHRINK,
        "--trainer.max_epochs=2",
        "--ckpt_path",
        "last",
    )
    meta = torch.load(last / "meta.pt", weights_only=False)
    assert meta["epoch"] == 1 and meta["global_step"] == 4  # the second epoch was trained after the resume
    _cli(tmp_path, "export", str(last), "teacher.safetensors")
    assert (tmp_path / "teacher.safetensors").is_file()
