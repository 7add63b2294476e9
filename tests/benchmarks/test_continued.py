"""benchmarks/continued.py, the command of each row of docs/training.md's continued-pretraining table: a row's
RankMe equals the formula computed here with numpy on the backbone's own embeddings, its k-NN is the weighted
vote's, the probe scores CamVid-shaped masks, and every documented row command runs, shrunk."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from bench_scripts import doc_commands, numpy_rankme
from bench_scripts import load_script as _load
from PIL import Image

from ssl_xcit.data.datamodule import DINODataModule
from ssl_xcit.models import build_backbone

REPO = Path(__file__).resolve().parents[2]
TINY_EVAL = ["--eval-size", "32", "--probe-short-side", "32", "--probe-crop", "32", "--probe-stride", "16",
             "--probe-iters", "1", "--probe-batch", "2", "--threads", "1"]  # fmt: skip


def _sets(root: Path) -> tuple[Path, Path]:
    """A labelled folder (2 classes x 10 images) and a CamVid-shaped tree (train/val images and masks)."""
    rng = np.random.default_rng(0)
    for c in range(2):
        (root / "flowers" / f"c{c}").mkdir(parents=True)
        for i in range(10):
            pixels = rng.integers(0, 120, (40, 40, 3)) + (120 if c else 0)
            Image.fromarray(pixels.astype(np.uint8)).save(root / "flowers" / f"c{c}" / f"{i}.png")
    for split in ("train", "val"):
        (root / "camvid" / split / "images").mkdir(parents=True)
        (root / "camvid" / split / "masks").mkdir()
        for i in range(2):
            image = rng.integers(0, 60, (48, 64, 3))
            image[:, 32:, 2] += 180
            mask = np.zeros((48, 64), np.uint8)
            mask[:, 32:] = 1
            Image.fromarray(image.astype(np.uint8)).save(root / "camvid" / split / "images" / f"{i}.png")
            Image.fromarray(mask).save(root / "camvid" / split / "masks" / f"{i}.png")
    return root / "flowers", root / "camvid"


def test_an_evaluated_row_is_rankme_and_knn_of_the_backbone(tmp_path):
    flowers, camvid = _sets(tmp_path)
    continued = _load("continued")
    save = tmp_path / "random.pth"
    row = continued.main([
        "--evaluate", "random", "--set", "backbone=vit_small_patch16_dinov3",
        "--set", "backbone_kwargs={depth: 1, init_values: 0.1}", "--set", "out_dim=32", "--save", str(save),
        "--flowers", str(flowers), "--camvid", str(camvid), "--probe", "--rows", str(tmp_path / "rows.jsonl"),
        *TINY_EVAL,
    ])  # fmt: skip
    held = DINODataModule(
        str(flowers), val_fraction=0.2, split_seed=0, eval_resize=32, eval_crop=32, batch_size=1
    )
    images = torch.stack([held.heldout_dataset()[i][0] for i in range(4)])
    backbone = build_backbone(save).eval()
    with torch.no_grad():
        cls, patches = backbone(images), backbone.forward_patch_tokens(images)[0]
    assert row["rankme_flowers5"]["embedding"] == pytest.approx(numpy_rankme(cls.double().numpy()), rel=1e-4)
    flat = patches.reshape(-1, patches.shape[-1]).double().numpy()
    assert row["rankme_flowers5"]["patch"] == pytest.approx(numpy_rankme(flat), rel=1e-4)
    assert row["knn_flowers5"] in (0.0, 25.0, 50.0, 75.0, 100.0)  # 4 held-out queries
    assert 0 <= row["miou_camvid"] <= 100 and row["training"] is None
    assert json.loads((tmp_path / "rows.jsonl").read_text())["rankme_camvid"] == row["rankme_camvid"]


@pytest.mark.slow
def test_the_docs_rows_run_in_order(tmp_path, monkeypatch):
    """Each documented row, shrunk (later flags win): one or two steps a run on the real flowers5 / CamVid train
    photos, evaluated on the tiny sets; the source row writes the file the continued rows start from."""
    flowers, camvid = _sets(tmp_path / "sets")
    monkeypatch.chdir(tmp_path)
    rows = doc_commands("continued.py")
    assert len(rows) >= 6  # random init, the source, and DINO / the recipe on flowers5 and on CamVid
    continued = _load("continued")
    for argv in rows:
        argv = [str(REPO / a) if a.startswith("recipes/") else a for a in argv]
        shrink = ["--flowers", str(flowers), "--camvid", str(camvid), *TINY_EVAL, "--batch-size", "4",
                  "--workers", "0", "--data-set", "local_crops_number=1"]  # fmt: skip
        if "--evaluate" not in argv:
            shrink += ["--limit-batches", "1", "--data-set", "global_crops_size=32", "--data-set",
                       "local_crops_size=16", "--data-set", "high_res_crops_size=[48, 16]"]  # fmt: skip
        row = continued.main([*argv, *shrink])
        assert 0 <= row["knn_flowers5"] <= 100 and row["rankme_camvid"]["embedding"] >= 1.0
