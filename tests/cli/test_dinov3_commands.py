"""Every command on a DINOv3 ViT and a DINOv3 ConvNeXt (tiny timm configurations): ``fit`` writes a run, and
``export`` (loaded strictly by timm's model of the same name, with equal outputs), ``embed``, ``knn``,
``linear``, ``segment``, ``retrieval`` (VLAD and ASMK over patch tokens) and ``visualize`` read it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

from ssl_xcit.cli import main
from ssl_xcit.cli.train import main as train_main
from ssl_xcit.evaluation.embedding_files import read_embeddings
from ssl_xcit.models import build_backbone

REPO = Path(__file__).resolve().parents[2]
# name -> (tiny backbone_kwargs as YAML, global crop, local crop); a ConvNeXt takes multiples of 32.
CASES = {
    "vit_small_patch16_dinov3": ("{embed_dim: 32, depth: 2, num_heads: 2}", 32, 16),
    "convnext_tiny": ("{depths: [1, 1, 1, 1], dims: [8, 8, 16, 16]}", 64, 32),
}
pytestmark = pytest.mark.filterwarnings("ignore:ASMK codebook k=", "ignore:k-means with k=")


def _fit(name: str, images: Path, tmp_path: Path) -> Path:
    kwargs, global_size, local_size = CASES[name]
    train_main([
        "fit", "-c", str(REPO / "recipes" / "dino_vit_s16.yaml"), f"--data.init_args.root={images}",
        f"--model.init_args.backbone={name}", f"--model.init_args.backbone_kwargs={kwargs}",
        "--model.init_args.out_dim=64", "--model.init_args.head_hidden_dim=32",
        "--model.init_args.head_bottleneck_dim=16", "--model.init_args.warmup_epochs=0",
        "--model.init_args.warmup_teacher_temp_epochs=0", "--data.init_args.batch_size=5",
        "--data.init_args.num_workers=0", "--data.init_args.persistent_workers=false",
        "--data.init_args.pin_memory=false", f"--data.init_args.global_crops_size={global_size}",
        f"--data.init_args.local_crops_size={local_size}", "--data.init_args.local_crops_number=2",
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1", "--trainer.strategy=auto",
        "--trainer.precision=32", "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
        "--trainer.logger=false", "--trainer.benchmark=false", f"--trainer.default_root_dir={tmp_path}",
    ])  # fmt: skip
    found = sorted(tmp_path.rglob("*.ckpt"))
    assert found, "fit wrote no checkpoint"
    return found[-1]


def _segment_folder(root: Path, n: int) -> Path:
    rng = np.random.default_rng(n)
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    for i in range(n):
        cut = 32 * int(rng.integers(1, 3))
        image = rng.integers(0, 60, (64, 96, 3))
        image[:, :cut, 0] += 180
        image[:, cut:, 2] += 180
        mask = np.zeros((64, 96), np.uint8)
        mask[:, cut:] = 1
        Image.fromarray(image.astype(np.uint8)).save(root / "images" / f"im{i}.png")
        Image.fromarray(mask).save(root / "masks" / f"im{i}.png")
    return root


@pytest.mark.slow  # fit + 8 commands per family: about 40 s on 2 cores
@pytest.mark.parametrize("name", list(CASES))
def test_every_command_runs_on_the_family(name, twenty_flowers, shared_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train, val = twenty_flowers
    ckpt = _fit(name, train, tmp_path / "run")
    teacher = build_backbone(ckpt).eval()
    assert teacher.name == name
    # export: timm's model of the same name takes the file strictly and gives the same embedding.
    out = tmp_path / "teacher.safetensors"
    assert main(["export", str(ckpt), str(out)])["model"] == name
    size = CASES[name][1]
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in yaml.safe_load(CASES[name][0]).items()}
    pool = {"global_pool": "token"} if name.startswith("vit_") else {}
    theirs = timm.create_model(name, pretrained=False, num_classes=0, **pool, **kwargs).eval()
    theirs.load_state_dict(load_file(str(out)), strict=True)
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), teacher(x), rtol=1e-5, atol=1e-5)
    # pt2: the ViT's graph holds one resolution (RoPE's tables), the ConvNeXt's any; each checked on export.
    fixed = ["--fixed-resolution"] if name.startswith("vit_") else []
    program = main(["export", str(ckpt), str(tmp_path / "teacher.pt2"), "--resolution", str(size), *fixed])
    assert program["format"] == "pt2"
    loaded = torch.export.load(str(tmp_path / "teacher.pt2")).module()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), teacher(x), rtol=1e-4, atol=1e-4)
    common = ["--resize-size", str(size + 8), "--crop-size", str(size), "--num-workers", "0", "--accelerator",
              "cpu", "--devices", "1", "--cache-dir", str(tmp_path / "cache"), "--no-progress"]  # fmt: skip
    # embed: the export's embeddings of the val photos equal the backbone's.
    embedded = main(["embed", "--weights", str(out), "--data", str(val), "--output", str(tmp_path / "e.npz"),
                     "--batch-size", "8", *common])  # fmt: skip
    assert embedded is not None and read_embeddings(tmp_path / "e.npz")["embeddings"].shape == (
        5,
        teacher.embed_dim,
    )
    knn = main(["knn", "--weights", str(out), "--train", str(train), "--val", str(val), "--k", "3",
                "--batch-size", "15", *common])  # fmt: skip
    assert knn["num_train"] == 15 and knn["num_val"] == 5 and 0 <= knn["results"]["3"]["top1"] <= 100
    linear = main(["linear", "--weights", str(out), "--train", str(train), "--val", str(val), "--fast",
                   "--epochs", "2", "--lrs", "0.01", "--batch-size", "15",
                   "--default-root-dir", str(tmp_path / "lin"), *common])  # fmt: skip
    assert linear["feature_dim"] == teacher.embed_dim
    seg_train, seg_val = _segment_folder(tmp_path / "seg_train", 2), _segment_folder(tmp_path / "seg_val", 1)
    # DINOv2's protocol (augmented crops, sliding windows over get_dense_layers), then the cached fast probe.
    for budget in (
        ["--iters", "2", "--crop-size", "64", "--stride", "48", "--batch-size", "2"],
        ["--fast", "--epochs", "1"],
    ):
        seg = main(["segment", "--weights", str(out), "--train", str(seg_train), "--val", str(seg_val), *budget,
                    "--num-workers", "0", "--accelerator", "cpu", "--no-cache", "--no-progress",
                    "--short-side", "64", "--output", str(tmp_path / "seg.json")])  # fmt: skip
        assert 0 <= seg["pixel_acc"] <= 100
    mini = shared_data / "retrieval_mini" / "ukbench"
    db = [str(mini / f"ukbench0000{i}.jpg") for i in range(4)]
    spec = {"database": db, "queries": db[:1], "positives": [[1, 2, 3]], "junk": [[]]}
    (tmp_path / "mini.json").write_text(json.dumps(spec))
    (tmp_path / "train.txt").write_text("\n".join(db) + "\n")
    for method in ("vlad", "asmk"):
        extra = ["--asmk-ma-query", "1"] if method == "asmk" else []
        result = main(["retrieval", "--weights", str(out), "--dataset", "json", "--data-root",
                       str(tmp_path / "mini.json"), "--method", method, "--resolution", "64", "--train-images",
                       str(tmp_path / "train.txt"), "--codebook-size", "2", "--local-dim", "8", "--no-cache",
                       "--output", str(tmp_path / f"{method}.json"), *extra])  # fmt: skip
        grid = 4 * 3 if name.startswith("vit_") else 2 * 2  # 64x48 in 16-px patches; 64x64 in 32-px cells
        assert result["local_descriptors_per_image"] == grid and 0 < result["metrics"]["mAP"] <= 1
    image = sorted((train / "daisy").glob("*.jpg"))[0]
    png = main(["visualize", "pca", "--weights", str(out), "--size", "64", str(image), "--out", str(tmp_path),
                "--no-progress"])  # fmt: skip
    assert Path(png).is_file()
    if name.startswith("vit_"):  # the CLS query's attention over the patches; a ConvNeXt has none
        png = main(["visualize", "attention", "--weights", str(out), "--size", "64", str(image), "--out",
                    str(tmp_path / "att"), "--no-progress"])  # fmt: skip
        assert Path(png).is_file()
