"""benchmarks/learning.py runs end to end on tiny settings (the numbers it prints are measured, not tested)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from ssl_xcit.data.synthetic import ensure_synthetic_dataset

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "learning.py"


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
        "--save", str(tmp_path / "teacher.pth"), "--save-every-epoch",
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
