"""``ssl-xcit segment --fast`` (the head on cached tokens): the probe learns an easy constructed task, runs end to
end on CamVid photos and on a VOC layout, writes predictions that rescore to its own numbers, reuses the cache,
and rejects bad data in one line. The default protocol: test_segment_protocol.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ssl_xcit.cli import console_main, main
from ssl_xcit.evaluation.segmentation import run_segment
from ssl_xcit.evaluation.segmentation.data import VOC_CLASSES, feature_size

from .helpers import ARCH

TINY = ["--arch", ARCH, "--num-workers", "0", "--accelerator", "cpu", "--no-progress"]


def halves(rng: np.random.Generator, size: tuple[int, int] = (64, 64)) -> tuple[np.ndarray, np.ndarray]:
    """An image whose left part is reddish (class 0) and right part bluish (class 1), split at a random column
    (a multiple of 16: whole patches); the mask's top row is unlabelled (255)."""
    h, w = size
    cut = 16 * int(rng.integers(1, w // 16))
    image = rng.integers(0, 60, (h, w, 3))
    image[:, :cut, 0] += 180
    image[:, cut:, 2] += 180
    mask = np.zeros((h, w), np.uint8)
    mask[:, cut:] = 1
    mask[0] = 255
    return image.astype(np.uint8), mask


def write_folder(root: Path, pairs: list[tuple[np.ndarray, np.ndarray]], prefix: str = "im") -> Path:
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    for i, (image, mask) in enumerate(pairs):
        Image.fromarray(image).save(root / "images" / f"{prefix}{i}.png")
        Image.fromarray(mask).save(root / "masks" / f"{prefix}{i}.png")
    return root


def rescore(pred_dir: Path, masks: dict[str, np.ndarray], k: int, ignore: int) -> tuple[float, float]:
    """mIoU and pixel accuracy of prediction PNGs, by a numpy bincount (independent of the package)."""
    matrix = np.zeros((k, k), np.int64)
    for stem, true in masks.items():
        pred = np.asarray(Image.open(pred_dir / f"{stem}.png")).astype(np.int64)
        assert pred.shape == true.shape
        keep = true != ignore
        matrix += np.bincount(true[keep] * k + pred[keep], minlength=k * k).reshape(k, k)
    inter = np.diag(matrix)
    union = matrix.sum(0) + matrix.sum(1) - inter
    with np.errstate(invalid="ignore", divide="ignore"):
        iou = inter / union * 100
    return float(np.nanmean(iou)), float(inter.sum() / matrix.sum() * 100)


def test_feature_size_rounds_each_side_to_the_patch_multiple():
    assert feature_size(360, 480, 16) == (368, 480)  # 22.5 patches round to 23
    assert feature_size(360, 480, 8) == (360, 480)
    assert feature_size(360, 480, 16, short_side=64) == (64, 80)  # 85.3 -> 80
    assert feature_size(5, 7, 16) == (16, 16)  # at least one patch


def test_probe_learns_an_easy_constructed_task(tmp_path):
    rng = np.random.default_rng(0)
    train = write_folder(tmp_path / "train", [halves(rng, (64, 128)) for _ in range(8)])
    val = write_folder(tmp_path / "val", [halves(rng, (64, 128)) for _ in range(4)])
    common = dict(
        arch="xcit_nano_12_p8",
        num_workers=0,
        accelerator="cpu",
        progress=False,
        cache_dir=tmp_path / "c",
        fast=True,
    )
    # 60 steps is a tiny budget for DINOv2's lr of 1e-3 (76 % mIoU here); 1e-2 fits it (98 %).
    results = run_segment(train, val, epochs=30, batch_size=4, lr=1e-2, **common)
    assert results["num_classes"] == 2 and results["num_train"] == 8 and results["num_val"] == 4
    # Chance is ~50 % pixel accuracy and ~33 % mIoU; only pixels next to the cut, where the upsampled logits
    # blend two patches, are hard.
    assert results["miou"] > 90 and results["pixel_acc"] > 95
    # The same head without training (0 steps is refused, so 1 step at a negligible lr) stays near chance.
    untrained = run_segment(train, val, epochs=1, batch_size=8, lr=1e-9, **common)
    assert untrained["miou"] < 70 and untrained["feature_cache_hit"] == {"train": True, "val": True}


def test_a_module_passed_in_is_probed_and_keyed_on_itself(tmp_path):
    from ssl_xcit.evaluation.segmentation.pixels import PixelPatches

    rng = np.random.default_rng(0)
    train = write_folder(tmp_path / "train", [halves(rng, (64, 128)) for _ in range(4)])
    val = write_folder(tmp_path / "val", [halves(rng, (64, 128)) for _ in range(2)])
    common = dict(
        num_workers=0, accelerator="cpu", progress=False, cache_dir=tmp_path / "c", lr=1e-2, fast=True
    )
    # Red against blue is linear in raw pixels: every whole-patch token is right.
    pixels = run_segment(train, val, model=PixelPatches(16), epochs=20, **common)
    assert pixels["miou"] > 95 and pixels["feature_dim"] == 3 * 16 * 16
    other = run_segment(train, val, model=PixelPatches(8), epochs=1, **common)
    assert other["feature_cache_hit"] == {"train": False, "val": False} and other["feature_dim"] == 192


@pytest.fixture(scope="module")
def camvid_few(shared_data, tmp_path_factory):
    """3 train + 2 val CamVid photos and masks (symlinked), the void id 11."""
    root = tmp_path_factory.mktemp("camvid_few")
    for split, n in (("train", 3), ("val", 2)):
        for sub in ("images", "masks"):
            (root / split / sub).mkdir(parents=True)
        for image in sorted((shared_data / "camvid" / split / "images").glob("*.jpg"))[:n]:
            (root / split / "images" / image.name).symlink_to(image)
            mask = shared_data / "camvid" / split / "masks" / f"{image.stem}.png"
            (root / split / "masks" / mask.name).symlink_to(mask)
    return root


def test_cli_on_camvid_writes_results_and_predictions_that_rescore_the_same(camvid_few, tmp_path):
    args = ["segment", *TINY, "--train", str(camvid_few / "train"), "--val", str(camvid_few / "val"),
            "--ignore-index", "11", "--short-side", "64", "--fast", "--epochs", "2",
            "--batch-size", "3", "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    out, preds = tmp_path / "seg.json", tmp_path / "preds"
    results = main([*args, "--output", str(out), "--predictions", str(preds)])
    written = json.loads(out.read_text())
    assert written["miou"] == pytest.approx(results["miou"]) and 0 <= written["miou"] <= 100
    k = written["num_classes"]  # inferred: 1 + the largest id in these 5 masks, void (11) aside
    assert 2 <= k <= 11 and len(written["per_class_iou"]) == k
    assert written["num_train"] == 3 and written["num_val"] == 2
    assert written["feature_cache_hit"] == {"train": False, "val": False}
    masks = {
        p.stem: np.asarray(Image.open(p)).astype(np.int64)
        for p in sorted((camvid_few / "val" / "masks").iterdir())
    }
    assert sorted(p.name for p in preds.iterdir()) == [f"{s}.png" for s in masks]
    assert all(Image.open(preds / f"{s}.png").size == (480, 360) for s in masks)  # the mask's full size
    miou, acc = rescore(preds, masks, k, 11)
    assert miou == pytest.approx(written["miou"]) and acc == pytest.approx(written["pixel_acc"])
    again = main(args)
    assert again["feature_cache_hit"] == {"train": True, "val": True}
    assert again["miou"] == pytest.approx(results["miou"])


def _voc(root: Path, names: dict[str, list[str]], rng: np.random.Generator) -> Path:
    for sub in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / sub).mkdir(parents=True)
    palette = list(np.random.default_rng(1).integers(0, 256, 768))
    for split, stems in names.items():
        (root / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("\n".join(stems) + "\n")
        for stem in stems:
            image, mask = halves(rng, (48, 80))
            mask[mask == 1] = 15  # person, on background
            mask[:, -2:] = 255  # a border, as VOC draws one
            Image.fromarray(image).save(root / "JPEGImages" / f"{stem}.jpg", quality=95)
            png = Image.fromarray(mask, mode="L").convert("P")
            png.putpalette(palette)
            png.save(root / "SegmentationClass" / f"{stem}.png")
    return root


def test_voc_layout_reads_the_split_lists(tmp_path):
    rng = np.random.default_rng(0)
    voc = _voc(tmp_path / "VOC2012", {"train": ["2007_000001", "2007_000002", "2007_000003"],
                                      "val": ["2008_000001", "2008_000002"]}, rng)  # fmt: skip
    Image.fromarray(halves(rng)[0]).save(voc / "JPEGImages" / "not_listed.jpg")  # in no list: never read
    results = main(["segment", *TINY, "--train", str(voc), "--val", str(voc), "--num-classes", "21",
                    "--fast", "--epochs", "1", "--cache-dir", str(tmp_path / "c"), "--predictions", str(tmp_path / "p")])  # fmt: skip
    assert results["num_train"] == 3 and results["num_val"] == 2 and results["ignore_index"] == 255
    assert list(results["per_class_iou"]) == list(VOC_CLASSES)
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["2008_000001.png", "2008_000002.png"]
    # A class in neither the val masks (background, person, 255) nor the predictions is NaN (null), any other
    # has a number.
    seen = {0, 15} | {
        int(v) for p in (tmp_path / "p").iterdir() for v in np.unique(np.asarray(Image.open(p)))
    }
    for k, name in enumerate(VOC_CLASSES):
        assert (results["per_class_iou"][name] is None) == (k not in seen), name
    assert len(seen) < 21


def _fail(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        console_main(["segment", *TINY, *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[1].startswith("(add --traceback")
    return err[0]


def test_bad_data_gives_one_line_errors(tmp_path, capsys):
    rng = np.random.default_rng(0)
    good = write_folder(tmp_path / "good", [halves(rng) for _ in range(2)])
    cache = ["--cache-dir", str(tmp_path / "c")]
    line = _fail(["--train", str(tmp_path / "nope"), "--val", str(good), *cache], capsys)
    assert "segmentation data folder not found" in line and "nope" in line
    (tmp_path / "no_masks" / "images").mkdir(parents=True)
    assert "no masks/ folder" in _fail(["--train", str(tmp_path / "no_masks"), "--val", str(good)], capsys)
    odd = write_folder(tmp_path / "odd", [halves(rng) for _ in range(2)])
    (odd / "masks" / "im1.png").rename(odd / "masks" / "other.png")
    line = _fail(["--train", str(odd), "--val", str(good), *cache], capsys)
    assert "images without a mask (im1)" in line and "masks without an image (other)" in line
    image, mask = halves(rng)
    mask[5, 5] = 7
    high = write_folder(tmp_path / "high", [halves(rng), (image, mask)])
    line = _fail(["--train", str(good), "--val", str(high), "--num-classes", "2", *cache], capsys)
    assert "class ids [7]" in line and "2 classes" in line and "ignore index is 255" in line
    small = write_folder(tmp_path / "small", [halves(rng)])
    Image.fromarray(np.zeros((10, 10), np.uint8)).save(small / "masks" / "im0.png")
    assert "is 10x10 but its image is 64x64" in _fail(["--train", str(small), "--val", str(good)], capsys)
    rgb = write_folder(tmp_path / "rgb", [halves(rng)])
    Image.fromarray(halves(rng)[0]).save(rgb / "masks" / "im0.png")
    assert "is a RGB image" in _fail(["--train", str(rgb), "--val", str(good)], capsys)
    line = _fail(["--train", str(good), "--val", str(good), "--ignore-index", "1"], capsys)
    assert "ignore index must not be a class id" in line


FAMILIES = [
    ("xcit_nano_12_p16", {"depth": 4}),
    ("cait_xxs24", {"depth": 4}),
    ("vit_small_patch16_224", {"depth": 4}),
    ("crossformerpp_small", {"depths": (1, 1, 1, 1)}),  # the last 4 blocks span all 4 stages
    ("bixt_ti_l64_p16", {"depth": 5}),  # 4 bi-directional layers
]


@pytest.mark.parametrize("name,kwargs", FAMILIES)
def test_every_family_gives_a_patch_grid_and_runs_the_probe(name, kwargs, tmp_path):
    import torch

    from ssl_xcit.evaluation.segmentation.features import dense_tokens
    from ssl_xcit.models import create_model

    torch.manual_seed(0)
    model = create_model(name, **kwargs).eval()
    m = model.size_multiple
    images = torch.randn(2, 3, 2 * m, 3 * m)
    with torch.no_grad():
        last, grid = dense_tokens(model, images, 1)
        four, grid4 = dense_tokens(model, images, 4)
        blocks = model.get_dense_layers(images, 4)
    # The last block's final-norm tokens (CrossFormer++: stage 4, 8C wide, stride 32), on their grid.
    torch.testing.assert_close(last, blocks[-1])
    assert last.shape[1] == grid[0] * grid[1] and grid[1] / grid[0] == 1.5
    assert grid4[1] / grid4[0] == 1.5 and four.shape[:2] == (2, grid4[0] * grid4[1])
    assert four.shape[2] == sum(b.shape[2] for b in blocks)
    rng = np.random.default_rng(0)
    size = (2 * m, 3 * m)
    train = write_folder(tmp_path / "train", [halves(rng, size) for _ in range(2)])
    val = write_folder(tmp_path / "val", [halves(rng, size)])
    # The module itself (checkpoint loading is knn's and is tested per family in test_families.py).
    results = run_segment(train, val, model=model, layers=4, fast=True, epochs=1, num_workers=0,
                          accelerator="cpu", progress=False, cache_dir=tmp_path / "c")  # fmt: skip
    assert results["feature_dim"] == four.shape[2] and 0 <= results["pixel_acc"] <= 100
