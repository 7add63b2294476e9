"""Every command that reads weights takes the `.safetensors` of `ssl-xcit export` and gives what it gives for
the `.pth` of the same teacher: knn, linear, retrieval and visualize (all read through ``build_backbone``)."""

from __future__ import annotations

import json

import pytest
import torch

from ssl_xcit.cli import main
from ssl_xcit.models import build_backbone, create_model

pytestmark = pytest.mark.filterwarnings("ignore:ASMK codebook k=", "ignore:k-means with k=")
NAME, KWARGS = "xcit_nano_12_p16", {"depth": 1, "tokens_norm": True}  # a recipe the shapes cannot tell


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The teacher of a fake DINO checkpoint exported as .safetensors and as .pth."""
    root = tmp_path_factory.mktemp("exports")
    torch.manual_seed(0)
    teacher, student = create_model(NAME, **KWARGS), create_model(NAME, **KWARGS)
    with torch.no_grad():  # away from the init, whose tiny LayerScale makes tokens_norm change almost nothing
        for param in teacher.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    state = {f"teacher.backbone.{k}": v for k, v in teacher.state_dict().items()}
    state |= {f"student.backbone.{k}": v for k, v in student.state_dict().items()}
    torch.save(
        {"state_dict": state, "hyper_parameters": {"backbone": NAME, "backbone_kwargs": KWARGS}}, root / "c"
    )
    for suffix in (".safetensors", ".pth"):
        main(["export", str(root / "c"), str(root / f"teacher{suffix}")])
    return root / "teacher.safetensors", root / "teacher.pth"


@pytest.fixture(scope="module")
def flowers(small_flowers):
    """3 classes x (3 train + 1 val) flowers5 photos."""
    return small_flowers(3)


def _features(weights, flowers, cache):
    return ["--weights", str(weights), "--train", str(flowers[0]), "--val", str(flowers[1]), "--resize-size",
            "32", "--crop-size", "32", "--batch-size", "12", "--num-workers", "0", "--accelerator", "cpu",
            "--devices", "1", "--cache-dir", str(cache), "--no-progress"]  # fmt: skip


def _drop_paths(result):
    return {
        k: v for k, v in result.items() if not isinstance(v, str) and k not in ("seconds", "wall_seconds")
    }


def test_knn_and_linear_read_safetensors(exports, flowers, tmp_path):
    results = []
    for weights in exports:
        knn = main(["knn", *_features(weights, flowers, tmp_path / weights.suffix), "--k", "3"])
        linear = main(["linear", *_features(weights, flowers, tmp_path / weights.suffix), "--fast", "--epochs",
                       "2", "--lrs", "0.01", "--default-root-dir", str(tmp_path / f"lin{weights.suffix}")])  # fmt: skip
        results.append((knn["results"], linear["best"]))
    assert results[0] == results[1]


def test_retrieval_reads_safetensors(exports, shared_data, tmp_path):
    mini = shared_data / "retrieval_mini" / "ukbench"
    db = [mini / f"ukbench0000{i}.jpg" for i in range(8)]
    spec = {"database": [str(p) for p in db], "queries": [str(db[0])], "positives": [[1, 2, 3]], "junk": [[]]}
    (tmp_path / "mini.json").write_text(json.dumps(spec))
    metrics = []
    for weights in exports:
        result = main(["retrieval", "--weights", str(weights), "--dataset", "json", "--data-root",
                       str(tmp_path / "mini.json"), "--method", "cls", "--resolution", "64", "--no-cache",
                       "--output", str(tmp_path / f"r{weights.suffix}.json")])  # fmt: skip
        metrics.append(result["metrics"])
    assert metrics[0] == metrics[1] and metrics[0]["n_queries"] == 1


def test_visualize_reads_safetensors(exports, shared_data, tmp_path):
    image = sorted((shared_data / "flowers5" / "daisy").glob("*.jpg"))[0]
    pictures = []
    for weights in exports:
        png = main(["visualize", "attention", "--weights", str(weights), "--size", "64", "--no-progress",
                    str(image), "--out", str(tmp_path / weights.suffix[1:])])  # fmt: skip
        pictures.append(png.read_bytes())
    assert pictures[0] == pictures[1]
    assert build_backbone(exports[0]).cls_attn_blocks[0].tokens_norm is True  # the recipe, not the default
