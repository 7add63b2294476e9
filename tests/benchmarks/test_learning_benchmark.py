"""benchmarks/learning.py runs end to end on tiny settings (the numbers it prints are measured, not tested)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ssl_xcit.data.synthetic import ensure_synthetic_dataset

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "learning.py"


@pytest.mark.slow  # moved out of the default suite (its 10-minute budget)
def test_learning_benchmark_reports_dino_random_init_and_pixels(tmp_path):
    spec = importlib.util.spec_from_file_location("learning_benchmark", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    root = ensure_synthetic_dataset(tmp_path / "shapes", num_train_per_class=2, num_val_per_class=1)
    out = tmp_path / "results.jsonl"
    result = bench.run(bench.parse_args([
        "--data-set", f"root={root / 'train'}", "--data-set", f"val_root={root / 'val'}",
        "--data-set", "batch_size=4", "--data-set", "global_crops_size=32", "--data-set", "local_crops_size=16",
        "--data-set", "local_crops_number=2", "--data-set", "eval_resize=32", "--data-set", "eval_crop=32",
        "--set", "backbone=vit_tiny_patch16_224", "--set", "backbone_kwargs={depth: 1, patch_size: 8}",
        "--set", "out_dim=32",
        "--set", "head_hidden_dim=16", "--set", "head_bottleneck_dim=8", "--set", "warmup_epochs=0",
        "--epochs", "1", "--workers", "0", "--json", str(out), "--tag", "tiny",
        "--save", str(tmp_path / "teacher.pth"), "--save-every-epoch", "--save-ckpt", str(tmp_path / "run.ckpt"),
    ]))  # fmt: skip
    assert result["steps"] == 5  # 20 images / batch 4
    assert [h["step"] for h in result["knn_history"]] == [0, 5]  # random init, then the trained teacher
    for key in ("knn_dino", "knn_random_init", "knn_raw_pixels", "knn_student"):
        assert 0.0 <= result[key] <= 100.0
    assert json.loads(out.read_text())["tag"] == "tiny"
    # The saved teacher names its architecture: a ViT with 8-px patches is not a registered variant, and
    # build_backbone (the retrieval benchmarks' loader) rebuilds it from the file alone.
    from ssl_xcit.models import build_backbone

    for name in ("teacher.pth", "teacher_e1.pth"):
        backbone = build_backbone(tmp_path / name)
        assert (backbone.name, backbone.patch_size, len(backbone.blocks)) == ("vit_tiny_patch16_224", 8, 1)

    # --save-ckpt: the whole run, heads included: a teacher for the dino and dinov3 distillation objectives.
    from ssl_xcit.dino.distill import read_teacher

    assert read_teacher(str(tmp_path / "run.ckpt")).head.last_layer.weight_v.shape[0] == 32

    # --distill: the same student against the frozen teacher just saved; the k-NN and --save take the student,
    # and every k-NN evaluation carries the training time spent before it (equal-wall-time comparisons).
    distilled = bench.run(bench.parse_args([
        "--data-set", f"root={root / 'train'}", "--data-set", f"val_root={root / 'val'}",
        "--data-set", "batch_size=4", "--data-set", "global_crops_size=32", "--data-set", "local_crops_number=0",
        "--data-set", "eval_resize=32", "--data-set", "eval_crop=32",
        "--set", "backbone=vit_tiny_patch16_224", "--set", "backbone_kwargs={depth: 1, patch_size: 16}",
        "--set", "warmup_epochs=0", "--epochs", "2", "--knn-every", "1", "--workers", "0",
        "--distill", str(tmp_path / "teacher.pth"), "--save", str(tmp_path / "student.pth"),
    ]))  # fmt: skip
    assert distilled["distill"] == str(tmp_path / "teacher.pth")
    assert [h["step"] for h in distilled["knn_history"]] == [0, 5, 10]
    seconds = [h["train_seconds"] for h in distilled["knn_history"]]
    assert seconds[0] == 0.0 and seconds[0] < seconds[1] < seconds[2]
    student = build_backbone(tmp_path / "student.pth")
    # the student's architecture, not the teacher's
    assert (student.patch_size, len(student.blocks)) == (16, 1)


def test_no_knn_trains_and_saves_without_labels(tmp_path):
    """--no-knn (implied by --data camvid, whose photos have no labels): training and --save, no k-NN rows."""
    spec = importlib.util.spec_from_file_location("learning_benchmark", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    root = ensure_synthetic_dataset(tmp_path / "shapes", num_train_per_class=1, num_val_per_class=1)
    result = bench.run(bench.parse_args([
        "--data-set", f"root={root / 'train'}", "--data-set", "batch_size=5", "--data-set", "global_crops_size=32",
        "--data-set", "local_crops_number=0", "--set", "backbone=vit_tiny_patch16_224",
        "--set", "backbone_kwargs={depth: 1, patch_size: 16}", "--set", "out_dim=16", "--set", "warmup_epochs=0",
        "--epochs", "1", "--workers", "0", "--no-knn", "--save", str(tmp_path / "t.pth"),
    ]))  # fmt: skip
    assert result["steps"] == 2
    assert result["knn_history"] == [] and result["knn_dino"] is None and result["knn_raw_pixels"] is None
    assert (tmp_path / "t.pth").is_file()
    assert bench.parse_args(["--data", "camvid"]).data == "camvid"
    assert bench.data_kwargs("camvid")["root"].endswith("camvid/train/images")
