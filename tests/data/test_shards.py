"""``prepare_shards`` and the shard readers: exact bytes, order, skipped files, interrupted runs, resizing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from litdata import StreamingDataset
from PIL import Image

from ssl_xcit.data.shards import META_FILE, decode_image, is_shard_root, prepare_shards, read_meta
from ssl_xcit.errors import UserError


def make_folder(root: Path, sizes: dict[str, list[tuple[int, int]]], fmt: str = "JPEG") -> Path:
    """An ImageFolder of random-noise images: ``{class: [(width, height), ...]}``."""
    rng = np.random.default_rng(0)
    ext = {"JPEG": "jpg", "PNG": "png"}[fmt]
    for name, shapes in sizes.items():
        (root / name).mkdir(parents=True)
        for i, (w, h) in enumerate(shapes):
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"img{i:02d}.{ext}", fmt)
    return root


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return make_folder(tmp_path / "src", {"cat": [(40, 30)] * 4, "dog": [(30, 50)] * 3})


def records(root: Path) -> list[dict]:
    ds = StreamingDataset(str(root))
    return [ds[i] for i in range(len(ds))]


@pytest.mark.parametrize("workers", [1, 2])
def test_prepare_keeps_bytes_labels_and_order(folder: Path, tmp_path: Path, workers: int) -> None:
    (folder / "dog" / "img99.jpg").write_bytes(b"not an image")  # sorts last in dog/
    # Small chunks: several shards per worker, so the order across chunks and workers is exercised.
    meta = prepare_shards(folder, tmp_path / "out", workers=workers, chunk_bytes="3KB", progress=False)
    files = sorted(folder.rglob("*.jpg"))
    good = [p for p in files if p.name != "img99.jpg"]
    got = records(tmp_path / "out")
    assert [r["path"] for r in got] == [p.relative_to(folder).as_posix() for p in good]
    assert [r["image"] for r in got] == [p.read_bytes() for p in good]
    assert [r["label"] for r in got] == [0, 0, 0, 0, 1, 1, 1]
    assert meta == read_meta(tmp_path / "out")
    assert meta["classes"] == ["cat", "dog"]
    assert (meta["files"], meta["records"], meta["skipped"]) == (8, 7, ["dog/img99.jpg"])
    assert meta["samples"] == [[r["path"], r["label"]] for r in got]
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert meta["shards"] == len(index["chunks"]) > workers
    assert meta["bytes"] == sum(p.stat().st_size for p in (tmp_path / "out").glob("chunk-*.bin"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no temporary folder left


def test_prepare_list_file_unlabelled(folder: Path, tmp_path: Path) -> None:
    listing = folder / "some.txt"
    listing.write_text("dog/img01.jpg\ncat/img00.jpg\n")
    meta = prepare_shards(listing, tmp_path / "out", progress=False)
    assert meta["classes"] is None
    assert meta["samples"] == [["dog/img01.jpg", -1], ["cat/img00.jpg", -1]]
    assert [r["image"] for r in records(tmp_path / "out")] == [
        (folder / "dog/img01.jpg").read_bytes(),
        (folder / "cat/img00.jpg").read_bytes(),
    ]


def test_resize_short(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "src", {"a": [(120, 80), (20, 30)]})
    make_folder(tmp_path / "png", {"b": [(50, 90)]}, fmt="PNG")
    (src / "b").mkdir()
    (src / "b" / "img00.png").write_bytes((tmp_path / "png" / "b" / "img00.png").read_bytes())
    prepare_shards(src, tmp_path / "out", resize_short=32, progress=False)
    got = {r["path"]: r["image"] for r in records(tmp_path / "out")}
    assert decode_image(got["a/img00.jpg"]).size == (48, 32)
    assert Image.open(__import__("io").BytesIO(got["a/img00.jpg"])).format == "JPEG"
    assert got["a/img01.jpg"] == (src / "a" / "img01.jpg").read_bytes()  # shorter side 20 <= 32: untouched
    assert decode_image(got["b/img00.png"]).size == (32, 58)
    assert Image.open(__import__("io").BytesIO(got["b/img00.png"])).format == "PNG"


def test_refuses_finished_and_interrupted_outputs(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = prepare_shards(folder, out, progress=False)
    with pytest.raises(UserError, match="already a prepared dataset; pass --overwrite"):
        prepare_shards(folder, out, progress=False)
    # An interrupted run: chunks and index.json, no marker. Readers and prepare both refuse it.
    (out / META_FILE).unlink()
    assert is_shard_root(out)
    with pytest.raises(UserError, match=f"has no {META_FILE}: an interrupted"):
        read_meta(out)
    with pytest.raises(UserError, match="holds an interrupted `ssl-xcit prepare`.*--resume.*--overwrite"):
        prepare_shards(folder, out, progress=False)
    again = prepare_shards(folder, out, overwrite=True, progress=False)
    assert again["samples"] == first["samples"] and again["id"] != first["id"]
    assert read_meta(out)["id"] == again["id"]


def test_failure_mid_way_leaves_nothing(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import litdata

    def crash(*args, **kwargs):
        Path(kwargs["output_dir"], "index.json").write_text("{}")  # a half-written output ...
        raise RuntimeError("killed")

    monkeypatch.setattr(litdata, "optimize", crash)
    with pytest.raises(RuntimeError, match="killed"):
        prepare_shards(folder, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # ... is removed, never renamed into place


def test_bad_arguments(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing does not exist"):
        prepare_shards(tmp_path / "missing", tmp_path / "out", progress=False)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(UserError, match="file.txt is a file"):
        prepare_shards(folder, tmp_path / "file.txt", progress=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.md").write_text("x")
    with pytest.raises(UserError, match="full is a folder holding other files"):
        prepare_shards(folder, tmp_path / "full", overwrite=True, progress=False)
    with pytest.raises(UserError, match="already a prepared dataset; give the image folder"):
        prepare_shards(
            prepare_shards(folder, tmp_path / "out", progress=False) and tmp_path / "out", tmp_path / "o2"
        )
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.jpg").write_text("not a JPEG")
    with pytest.raises(
        UserError, match="no readable image in .*bad: all 1 files fail to decode, e.g. a.jpg: not"
    ):
        prepare_shards(tmp_path / "bad", tmp_path / "o4", progress=False)
    assert not (tmp_path / "o4").exists() and not list(tmp_path.glob(".o4.*"))
    with pytest.raises(UserError, match="--resize-short 0: give a positive"):
        prepare_shards(folder, tmp_path / "o3", resize_short=0)


# ----------------------------------------------------------------------------------- ShardImageDataset


def test_build_dataset_reads_shards_like_the_folder(folder: Path, tmp_path: Path) -> None:
    from ssl_xcit.data.datasets import build_dataset
    from ssl_xcit.data.shard_dataset import ShardImageDataset
    from ssl_xcit.data.transforms import eval_transform

    prepare_shards(folder, tmp_path / "out", workers=2, chunk_bytes="3KB", progress=False)
    transform = eval_transform(resize=36, crop=32)
    files, shards = build_dataset(folder, transform), build_dataset(tmp_path / "out", transform)
    assert isinstance(shards, ShardImageDataset)
    assert shards.classes == files.classes and shards.targets == files.targets and len(shards) == len(files)
    assert [p.as_posix() for p, _ in shards.samples] == [
        p.relative_to(folder).as_posix() for p, _ in files.samples
    ]
    for i in range(len(files)):
        a, b = files[i], shards[i]
        assert torch.equal(a[0], b[0]) and a[1:] == b[1:] == (files.targets[i], i)
    unlabelled = build_dataset(tmp_path / "out", labelled=False)
    assert unlabelled.classes is None and set(unlabelled.targets) == {-1}
    part = shards.subset([5, 1])
    assert part.targets == [1, 0] and torch.equal(part[0][0], shards[5][0]) and part[0][2] == 0


def test_corrupt_record_is_skipped_and_counted(tmp_path: Path) -> None:
    """A record whose bytes do not decode (written with LitData directly) gives ``None`` once, is counted, and
    the collate drops it from the batch, also with DataLoader workers."""
    import litdata
    from torch.utils.data import DataLoader

    from ssl_xcit.data.datasets import UnreadableImageWarning, collate_skip_none
    from ssl_xcit.data.shard_dataset import ShardImageDataset
    from ssl_xcit.data.transforms import eval_transform

    good = make_folder(tmp_path / "src", {"a": [(20, 20)] * 2})
    images = [
        (good / "a" / "img00.jpg").read_bytes(),
        b"\xff\xd8 truncated",
        (good / "a" / "img01.jpg").read_bytes(),
    ]
    out = tmp_path / "out"
    litdata.optimize(
        _write_raw,
        [(data, f"a/{i}.jpg") for i, data in enumerate(images)],
        output_dir=str(out),
        chunk_bytes="64MB",
        num_workers=1,
        reorder_files=False,
        keep_data_ordered=True,
        verbose=False,
        start_method="fork",
    )
    samples = [[f"a/{i}.jpg", 0] for i in range(3)]
    (out / META_FILE).write_text(json.dumps({"format": 1, "id": "x", "classes": ["a"], "samples": samples}))
    ds = ShardImageDataset(out, eval_transform(resize=18, crop=16))
    # Workers flag the record in shared memory (their warnings stay in the workers).
    loader = DataLoader(ds, batch_size=3, num_workers=2, collate_fn=collate_skip_none)
    batches = [b for _ in range(2) for b in loader]
    assert [b[2].tolist() for b in batches] == [[0, 2], [0, 2]]
    assert ds.num_skipped == 1 and [p.as_posix() for p in ds.skipped_paths()] == ["a/1.jpg"]
    fresh = ShardImageDataset(out)
    with pytest.warns(UnreadableImageWarning, match="skipping unreadable image a/1.jpg"):
        assert fresh[1] is None
    assert fresh[1] is None and fresh.num_skipped == 1 and fresh.verify() == 1


def _write_raw(item: tuple[bytes, str]) -> dict:
    return {"image": item[0], "label": 0, "path": item[1]}


def test_shards_feature_cache_key_changes_with_each_preparation(folder: Path, tmp_path: Path) -> None:
    from ssl_xcit.data.datasets import build_dataset
    from ssl_xcit.evaluation.features import FeatureConfig
    from ssl_xcit.evaluation.keys import feature_meta

    def key() -> dict:
        return feature_meta(build_dataset(tmp_path / "out"), weights=None, arch="x", config=FeatureConfig(1))

    prepare_shards(folder, tmp_path / "out", progress=False)
    first = key()
    assert key() == first
    prepare_shards(folder, tmp_path / "out", overwrite=True, resize_short=16, progress=False)
    assert key()["files"] != first["files"]  # same paths and labels, other pixels: never a stale cache hit


# ----------------------------------------------------------------------------------- object storage


def test_unsupported_url_scheme_is_one_line() -> None:
    with pytest.raises(
        UserError, match="azure://c/ds: this version of ssl-xcit reads prepared datasets from s3://"
    ):
        read_meta("azure://c/ds")


def test_paths_that_exist_from_the_working_folder_stay_strings(
    folder: Path, tmp_path: Path, monkeypatch
) -> None:
    """LitData stores a string that names an existing file as that file's content (its format is inferred from
    the first record); run from inside SRC, every relative path names a file. They must stay paths."""
    monkeypatch.chdir(folder)
    prepare_shards(".", tmp_path / "out", workers=2, progress=False)
    got = records(tmp_path / "out")
    assert [r["path"] for r in got] == [
        p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*.jpg"))
    ]
    assert [r["image"] for r in got] == [p.read_bytes() for p in sorted(folder.rglob("*.jpg"))]
