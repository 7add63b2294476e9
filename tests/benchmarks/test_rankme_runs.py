"""benchmarks/rankme_runs.py, the command of docs/training.md's RankMe picture, end to end on a tiny run of
benchmarks/learning.py: every point is RankMe (numpy, in the test) of that epoch's teacher on the held-out split,
step 0 is the run's own starting teacher, and the PNG is drawn."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from bench_scripts import load_script as _load
from bench_scripts import numpy_rankme

from ssl_xcit.data.datamodule import DINODataModule
from ssl_xcit.models import build_backbone

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
def test_rankme_runs_draws_the_curves_of_a_learning_run(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(2):
        (tmp_path / "data" / f"c{c}").mkdir(parents=True)
        for i in range(10):
            pixels = rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / "data" / f"c{c}" / f"{i}.png")
    learning = _load("learning")
    run = learning.run(learning.parse_args([
        "--data", str(tmp_path / "data"), "--data-set", "batch_size=4", "--data-set", "global_crops_size=32",
        "--data-set", "local_crops_size=16", "--data-set", "local_crops_number=1", "--data-set", "eval_resize=32",
        "--data-set", "eval_crop=32", "--set", "backbone=xcit_nano_12_p8", "--set", "backbone_kwargs={depth: 1}",
        "--set", "out_dim=32", "--set", "head_hidden_dim=16", "--set", "head_bottleneck_dim=8",
        "--set", "warmup_epochs=0", "--epochs", "2", "--workers", "0", "--json", str(tmp_path / "runs.jsonl"),
        "--tag", "tiny", "--save", str(tmp_path / "t.pth"), "--save-every-epoch",
    ]))  # fmt: skip
    assert run["steps"] == 8  # 16 training images (4 held out), batch 4, 2 epochs
    result = _load("rankme_runs").main([
        "--data", str(tmp_path / "data"), "--runs", str(tmp_path / "runs.jsonl"),
        "--weights", f"tiny={tmp_path / 't.pth'}", "--eval-size", "32", "--out", str(tmp_path / "rankme.png"),
        "--epochs", "1,2",
    ])  # fmt: skip
    points = result["runs"]["tiny"]["points"]
    assert [p["step"] for p in points] == [0, 4, 8] and result["images"] == 4
    held = DINODataModule(
        str(tmp_path / "data"), val_fraction=0.2, batch_size=1, eval_resize=32, eval_crop=32
    )
    images = torch.stack([held.heldout_dataset()[i][0] for i in range(4)])
    for point, weights in zip(points[1:], ("t_e1.pth", "t_e2.pth"), strict=True):
        with torch.no_grad():
            cls = build_backbone(tmp_path / weights).eval()(images)
        assert point["embedding"] == pytest.approx(numpy_rankme(cls.double().numpy()), rel=1e-4)
    assert result["runs"]["tiny"]["knn_start"] == run["knn_random_init"]
    assert (tmp_path / "rankme.png").stat().st_size > 10_000
