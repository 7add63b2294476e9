"""``ssl-xcit knn`` / ``ssl-xcit linear`` / LightningCLI on real photos (flowers5, deterministic split).

The backbone is a random-init xcit_nano_12_p16 at 64 px: its CLS embeddings are nearly collinear (pairwise
cosine ~0.9998), so these tests check that the pipeline runs and is consistent, not that the features are good.
"""

from __future__ import annotations

import json

import pytest
import torch

from ssl_xcit.cli import main
from ssl_xcit.data.datasets import build_dataset
from ssl_xcit.data.transforms import eval_transform
from ssl_xcit.evaluation.knn import knn_accuracy
from ssl_xcit.models import create_model

from .helpers import ARCH, CROP, RESIZE, TRAIN_PER_CLASS, VAL_PER_CLASS, small_args


def test_knn_cli_results_and_json(knn_run, flowers_split):
    results, out = knn_run
    assert json.loads((out / "knn.json").read_text()) == json.loads(json.dumps(results))
    assert results["num_train"] == 5 * TRAIN_PER_CLASS and results["num_val"] == 5 * VAL_PER_CLASS
    assert results["num_classes"] == 5 and results["ks"] == [10, 20, 100, 200]
    assert results["temperature"] == 0.07 and results["backend"] == "torch"
    assert results["init"] == "random (seed 0)" and results["checkpoint_sha256"] is None
    assert set(results["results"]) == {"10", "20", "100", "200"}
    for row in results["results"].values():
        assert 0.0 <= row["top1"] <= row["top5"] <= 100.0 and row["k"] == row["k_effective"]
    # At least one k beats chance (20 %) on 100 real val photos, even with these features.
    assert max(r["top1"] for r in results["results"].values()) > 30.0

    # The pipeline's numbers equal k-NN on features computed by hand with the same seed-0 backbone.
    train, val = flowers_split
    transform = eval_transform(resize=RESIZE, crop=CROP)
    tr, va = build_dataset(train, transform), build_dataset(val, transform)
    torch.manual_seed(0)
    model = create_model(ARCH).eval()
    with torch.no_grad():
        ftr = model(torch.stack([tr[i][0] for i in range(len(tr))]))
        fva = model(torch.stack([va[i][0] for i in range(len(va))]))
    direct = knn_accuracy(ftr, torch.tensor(tr.targets), fva, torch.tensor(va.targets))
    for k, row in direct.items():
        # Near-collinear features: allow a few queries to flip on float rounding between the two extractions.
        assert abs(row["top1"] - results["results"][str(k)]["top1"]) <= 3.0


def test_knn_cli_second_run_hits_cache_and_faiss_agrees(knn_run, flowers_split, monkeypatch):
    results, out = knn_run
    train, val = flowers_split
    import ssl_xcit.evaluation.cached as cached

    def forbidden(*args, **kwargs):
        raise AssertionError("the backbone must not be built on a cache hit")

    monkeypatch.setattr(cached, "build_eval_backbone", forbidden)
    again = main(["knn", *small_args(train, val, out / "cache"), "--backend", "faiss"])
    assert again["feature_cache_hit"] == {"train": True, "val": True}
    for k, row in results["results"].items():
        # Same features; faiss and torch round the 0.9998-ish similarities differently, so near-ties among the
        # neighbours may break the other way for a few of the 100 queries. On well-spread features the two
        # backends agree exactly (test_knn.py::test_torch_and_faiss_agree_on_larger_random_bank).
        assert abs(row["top1"] - again["results"][k]["top1"]) <= 3.0


def test_linear_fast_reuses_knn_cache(knn_run, flowers_split, monkeypatch, tmp_path):
    _, out = knn_run
    train, val = flowers_split
    import ssl_xcit.evaluation.cached as cached

    monkeypatch.setattr(cached, "build_eval_backbone", lambda *a, **k: pytest.fail("backbone built on a hit"))
    output = tmp_path / "linear.json"
    results = main(
        [
            "linear",
            *small_args(train, val, out / "cache"),
            "--fast",
            "--epochs",
            "5",
            "--lrs",
            "0.01",
            "1.0",
            "--output",
            str(output),
        ]
    )
    assert results["mode"] == "fast" and results["feature_cache_hit"] == {"train": True, "val": True}
    assert json.loads(output.read_text())["best"] == results["best"]
    assert [r["base_lr"] for r in results["per_lr"]] == [0.01, 1.0]
    assert results["per_lr"][1]["lr"] == pytest.approx(1.0 * 64 / 256)
    assert results["best"]["top1"] == max(r["top1"] for r in results["per_lr"])
    assert (
        results["num_train"] == 5 * TRAIN_PER_CLASS and results["num_classes"] == 5 and results["epochs"] == 5
    )


def test_linear_full_mode_cli(flowers_split, tmp_path):
    train, val = flowers_split
    weights = tmp_path / "nano.pth"
    torch.manual_seed(0)
    model = create_model(ARCH)
    torch.save({"model": model.state_dict()}, weights)  # a container layout, as official checkpoints use
    before = {k: v.clone() for k, v in model.state_dict().items()}
    results = main(
        [
            "linear",
            *small_args(train, val, tmp_path / "cache"),
            "--weights",
            str(weights),
            "--epochs",
            "1",
            "--default-root-dir",
            str(tmp_path / "run"),
            "--output",
            str(tmp_path / "linear.json"),
        ]
    )
    assert results["mode"] == "full" and results["num_train"] == 5 * TRAIN_PER_CLASS
    assert "RandomResizedCrop" in results["train_transform"] and "CenterCrop" in results["val_transform"]
    assert 0.0 <= results["best"]["top1"] <= 100.0 and results["best"]["top5"] == 100.0  # 5 classes
    assert results["checkpoint_sha256"] and results["weights"] == str(weights)
    # The Lightning checkpoint keeps only the heads; the frozen backbone is rebuilt from `weights`.
    ckpt = next((tmp_path / "run").rglob("*.ckpt"))
    keys = torch.load(ckpt, weights_only=False)["state_dict"].keys()
    assert keys and not any(k.startswith("backbone.") for k in keys)
    assert torch.load(weights, weights_only=True)["model"].keys() == before.keys()


def test_lightning_cli_route(flowers_split, tmp_path, repo_root):
    train, val = flowers_split
    weights = tmp_path / "nano.pth"
    torch.manual_seed(0)
    torch.save(create_model(ARCH).state_dict(), weights)
    output = tmp_path / "cli.json"
    cli = main(
        [
            "fit",
            "-c",
            str(repo_root / "eval" / "linear_xcit.yaml"),
            "--model.weights",
            str(weights),
            "--model.output",
            str(output),
            "--data.train",
            str(train),
            "--data.val",
            str(val),
            "--data.crop_size",
            str(CROP),
            "--data.resize_size",
            str(RESIZE),
            "--data.num_workers",
            "0",
            "--data.batch_size",
            "64",
            "--trainer.max_epochs",
            "1",
            "--trainer.accelerator",
            "cpu",
            "--trainer.devices",
            "1",
            "--trainer.logger",
            "false",
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
        ]
    )
    results = json.loads(output.read_text())
    assert results["protocol"] == "linear" and results["num_classes"] == 5 and results["epochs"] == 1
    assert results["per_lr"][0]["lr"] == pytest.approx(0.001 * 64 / 256)
    assert cli.model.backbone.training is False
