"""``ssl-xcit prepare`` end to end: k-NN on the shards equals k-NN on the folder exactly; one-line errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ssl_xcit.cli import console_main, main

ARCH, RESIZE, CROP = "xcit_nano_12_p16", 73, 64  # tiny backbone at a tiny size: seconds on 2 cores


@pytest.fixture(scope="module")
def flowers_small(shared_data: Path, tmp_path_factory) -> tuple[Path, Path]:
    """5 classes x 6 train and x 2 val photos of flowers5 (symlinked ImageFolder trees)."""
    root = tmp_path_factory.mktemp("flowers_small")
    for name in sorted(p.name for p in (shared_data / "flowers5").iterdir() if p.is_dir()):
        photos = sorted((shared_data / "flowers5" / name).glob("*.jpg"))[:8]
        for split, part in (("train", photos[:6]), ("val", photos[6:])):
            (root / split / name).mkdir(parents=True)
            for photo in part:
                os.symlink(photo, root / split / name / photo.name)
    return root / "train", root / "val"


def knn_args(train: Path, val: Path, cache: Path) -> list[str]:
    return [
        "knn", "--train", str(train), "--val", str(val), "--arch", ARCH, "--resize-size", str(RESIZE),
        "--crop-size", str(CROP), "--k", "3", "5", "--batch-size", "16", "--num-workers", "0",
        "--accelerator", "cpu", "--devices", "1", "--cache-dir", str(cache), "--no-progress",
    ]  # fmt: skip


def test_knn_on_shards_equals_knn_on_the_folder(flowers_small, tmp_path: Path, capsys) -> None:
    from ssl_xcit.data.datasets import build_dataset
    from ssl_xcit.data.transforms import eval_transform
    from ssl_xcit.evaluation.cached import dataset_features

    train, val = flowers_small
    summary = main(
        ["prepare", str(train), str(tmp_path / "train"), "--workers", "2", "--chunk-bytes", "20KB"]
    )
    assert summary["records"] == summary["files"] == 30 and summary["shards"] > 2
    assert f"prepared {tmp_path / 'train'}: 30 of 30 files (5 classes)" in capsys.readouterr().out
    main(["prepare", str(val), str(tmp_path / "val"), "--no-progress"])

    folders = main(knn_args(train, val, tmp_path / "cache_folders"))
    shards = main(knn_args(tmp_path / "train", tmp_path / "val", tmp_path / "cache_shards"))
    assert shards["results"] == folders["results"]
    assert (shards["num_train"], shards["num_val"]) == (folders["num_train"], folders["num_val"]) == (30, 10)

    transform = eval_transform(resize=RESIZE, crop=CROP)
    features = [
        dataset_features(
            build_dataset(root, transform), "train", weights=None, arch=ARCH, use_cache=False,
            batch_size=16, num_workers=0, accelerator="cpu", devices=1, progress=False,
        )[0]
        for root in (train, tmp_path / "train")
    ]  # fmt: skip
    assert torch.equal(features[0]["features"], features[1]["features"])
    assert torch.equal(features[0]["labels"], features[1]["labels"])

    # embed keys its rows by the records' paths, relative to the folder that was prepared.
    from ssl_xcit.evaluation.embedding_files import read_embeddings

    args = ["--arch", ARCH, "--resize-size", str(RESIZE), "--crop-size", str(CROP), "--num-workers", "0"]
    main(
        [
            "embed",
            "--data",
            str(tmp_path / "val"),
            "--output",
            str(tmp_path / "e.npz"),
            *args,
            "--no-progress",
        ]
    )
    rows = read_embeddings(tmp_path / "e.npz")
    assert rows["paths"] == [p.relative_to(val).as_posix() for p in sorted(val.rglob("*.jpg"))]


def _one_line_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        console_main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("ssl-xcit prepare: error: ") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 2  # the message and the --traceback hint
    return err.splitlines()[0]


def test_prepare_errors_are_one_line(tmp_path: Path, capsys) -> None:
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    from PIL import Image

    Image.new("RGB", (8, 8)).save(src / "x.png")
    err = _one_line_error(["prepare", str(tmp_path / "nope"), str(tmp_path / "out")], capsys)
    assert f"data root {tmp_path / 'nope'} does not exist" in err
    (src / "bad.jpg").write_bytes(b"\xff\xd8 not a JPEG")
    main(["prepare", str(tmp_path / "src"), str(tmp_path / "out"), "--no-progress"])
    out = capsys.readouterr().out  # the summary names every skipped file
    assert "1 of 2 files (1 classes)" in out and "; 1 unreadable files skipped\n  skipped a/bad.jpg: " in out
    err = _one_line_error(["prepare", str(tmp_path / "src"), str(tmp_path / "out")], capsys)
    assert f"{tmp_path / 'out'} is already a prepared dataset; pass --overwrite to replace it" in err
    (tmp_path / "out" / "ssl_xcit_shards.json").unlink()
    err = _one_line_error(["prepare", str(tmp_path / "src"), str(tmp_path / "out")], capsys)
    assert (
        "holds an interrupted `ssl-xcit prepare` (chunks, no ssl_xcit_shards.json); pass --resume to continue it "
        "or --overwrite" in err
    )
    err = _one_line_error(["prepare", str(tmp_path / "src"), str(tmp_path / "src")], capsys)
    assert "is a folder holding other files, not a prepared dataset" in err
    # Reading the interrupted output is refused too, by every command that reads data.
    with pytest.raises(SystemExit):
        console_main(
            ["knn", "--arch", ARCH, "--train", str(tmp_path / "out"), "--val", str(tmp_path / "out")]
        )
    assert "has no ssl_xcit_shards.json: an interrupted" in capsys.readouterr().err


@pytest.mark.slow  # moved out of the default suite (its 10-minute budget)
def test_linear_probe_on_shards_equals_the_folder(flowers_small, tmp_path: Path) -> None:
    train, val = flowers_small
    for name, root in (("train", train), ("val", val)):
        main(["prepare", str(root), str(tmp_path / name), "--no-progress"])

    def probe(train_root: Path, val_root: Path, tag: str) -> dict:
        return main([
            "linear", "--train", str(train_root), "--val", str(val_root), "--arch", ARCH, "--resize-size",
            str(RESIZE), "--crop-size", str(CROP), "--batch-size", "16", "--num-workers", "0", "--accelerator",
            "cpu", "--devices", "1", "--cache-dir", str(tmp_path / f"cache_{tag}"), "--no-progress", "--fast",
            "--epochs", "2", "--lrs", "0.01", "--default-root-dir", str(tmp_path / f"lin_{tag}"),
        ])  # fmt: skip

    folders = probe(train, val, "folders")
    shards = probe(tmp_path / "train", tmp_path / "val", "shards")
    assert shards["best"] == folders["best"]
    assert (shards["num_train"], shards["num_val"]) == (folders["num_train"], folders["num_val"]) == (30, 10)
