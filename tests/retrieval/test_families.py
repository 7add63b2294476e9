"""CLS / VLAD / ASMK retrieval on CaiT and timm-ViT backbones (retrieval_mini, depth-1 random models)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ssl_xcit.cli.retrieval import main
from ssl_xcit.models import create_model

pytestmark = pytest.mark.filterwarnings("ignore:ASMK codebook k=", "ignore:k-means with k=")
# LayerScale 1.0 for the random CaiT: with its 1e-5 init every image would get almost the same embedding.
FAMILIES = [
    ("cait_xxs24", {"depth": 1, "init_values": 1.0}),
    ("vit_small_patch16_224", {"depth": 1}),
    ("crossformerpp_small", {"depths": (1, 1, 1, 1)}),
    ("bixt_ti_l64_p16", {"depth": 2}),
]


@pytest.fixture(scope="module")
def bench(shared_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("retrieval_families")
    mini = shared_data / "retrieval_mini"
    db = [mini / "ukbench" / f"ukbench0000{i}.jpg" for i in range(8)]
    shutil.copy(
        db[5], root / "copy.jpg"
    )  # an exact copy stored elsewhere: it must retrieve its original first
    spec = {
        "database": [str(p) for p in db],
        "queries": [str(db[0]), str(root / "copy.jpg")],
        "positives": [[1, 2, 3], [5]],
        "junk": [[], []],
    }
    (root / "mini.json").write_text(json.dumps(spec))
    train = sorted((shared_data / "flowers5" / "daisy").glob("*.jpg"))[:4]
    (root / "train.txt").write_text("\n".join(map(str, train)) + "\n")
    return root


@pytest.mark.parametrize("name,kwargs", FAMILIES)
@pytest.mark.parametrize("method", ["cls", "vlad", "asmk"])
def test_retrieval_methods_run_on_the_family(bench, tmp_path, name, kwargs, method):
    torch.manual_seed(0)
    model = create_model(name, **kwargs)
    weights = tmp_path / "w.pth"
    torch.save(
        {"state_dict": model.state_dict(), "hyper_parameters": {"backbone": name, "backbone_kwargs": kwargs}},
        weights,
    )
    extra = ["--asmk-ma-query", "1"] if method == "asmk" else []
    out = tmp_path / "out.json"
    result = main(["--weights", str(weights), "--dataset", "json", "--data-root", str(bench / "mini.json"),
                   "--method", method, "--resolution", "64", "--train-images", str(bench / "train.txt"),
                   "--codebook-size", "4", "--local-dim", "16", "--no-cache", "--output", str(out), *extra])  # fmt: skip
    m = result["metrics"]
    assert result["n_database"] == 8 and m["n_queries"] == 2 and 0.0 < m["mAP"] <= 1.0
    assert result["top_ranks"][1][0] == 5 and m["aps"][1] == pytest.approx(1.0)  # the copy finds its original
    if method == "cls":
        assert result["descriptor_dim"] == model.embed_dim
    else:
        # 64 px long side of 4:3 photos: 64x48 -> 4x3 patches of 16 px, all kept as local descriptors;
        # CrossFormer++ takes multiples of 32, so 64x64 -> its 4x4 stage-3 tokens (stride 16).
        assert result["local_descriptors_per_image"] == (16 if name.startswith("crossformerpp") else 12)
