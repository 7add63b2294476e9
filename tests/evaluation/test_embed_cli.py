"""``ssl-xcit embed``: k-NN's features row for row, files every reader opens, skipped images named, no half-writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ssl_xcit.cli import main
from ssl_xcit.errors import UserError
from ssl_xcit.evaluation import embedding_files
from ssl_xcit.evaluation.cached import split_features
from ssl_xcit.evaluation.embedding_files import read_embeddings
from ssl_xcit.evaluation.features import FeatureConfig
from ssl_xcit.evaluation.knn import knn_search, knn_votes
from ssl_xcit.evaluation.pipeline import load_split_datasets

from .helpers import ARCH, CROP, RESIZE, small_args


def embed_args(data: Path, output: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "embed",
        "--arch",
        ARCH,
        "--data",
        str(data),
        "--output",
        str(output),
        "--resize-size",
        str(RESIZE),
        "--crop-size",
        str(CROP),
        "--batch-size",
        "64",
        "--num-workers",
        "0",
        "--accelerator",
        "cpu",
        "--devices",
        "1",
        "--cache-dir",
        str(cache),
        "--no-progress",
        *extra,
    ]


@pytest.fixture(scope="module")
def tiny_tree(shared_data, tmp_path_factory) -> Path:
    """Two classes of three photos, plus one corrupt file in the second class."""
    root = tmp_path_factory.mktemp("embed_tree")
    for name in ("daisy", "rose"):
        (root / name).mkdir()
        for path in sorted((shared_data / "flowers5" / name).glob("*.jpg"))[:3]:
            shutil.copy(path, root / name / path.name)
    (root / "rose" / "broken.jpg").write_bytes(b"not a jpeg")
    return root


@pytest.fixture(scope="module")
def tiny_npz(tiny_tree, tmp_path_factory):
    out = tmp_path_factory.mktemp("embed_out")
    with pytest.warns(UserWarning, match="broken.jpg"):
        summary = main(embed_args(tiny_tree, out / "emb.npz", out / "cache"))
    return summary, out / "emb.npz"


def test_embed_rows_equal_knn_features_and_faiss_finds_knns_neighbours(knn_run, flowers_split, tmp_path):
    import faiss

    results, run_dir = knn_run
    train, val = flowers_split
    # The features `ssl-xcit knn` used: its cache entries (both splits hit, nothing is recomputed).
    train_ds, val_ds = load_split_datasets(train, val, _eval())
    (tr, tr_hit), (va, va_hit), _ = split_features(
        train_ds, val_ds, weights=None, arch=ARCH, config=FeatureConfig(), cache_dir=run_dir / "cache",
        batch_size=64, num_workers=0, accelerator="cpu", devices=1, progress=False,
    )  # fmt: skip
    assert tr_hit and va_hit
    # embed computes its own (a fresh cache), so equality is between two extractions.
    main(embed_args(train, tmp_path / "train.npz", tmp_path / "cache"))
    main(embed_args(val, tmp_path / "val.npz", tmp_path / "cache"))
    with np.load(tmp_path / "train.npz", allow_pickle=False) as t, np.load(tmp_path / "val.npz") as v:
        bank, queries = torch.from_numpy(t["embeddings"]), torch.from_numpy(v["embeddings"])
        assert t["paths"].tolist() == [str(p) for p, _ in train_ds.samples]
        assert t["labels"].tolist() == tr["labels"].tolist()
        assert v["labels"].tolist() == va["labels"].tolist()
    assert torch.equal(bank, tr["features"]) and torch.equal(queries, va["features"])

    # What a user does with the rows: cosine search in faiss; k-NN's own search on its features.
    k = 20
    index = faiss.IndexFlatIP(bank.shape[1])
    index.add(F.normalize(bank, dim=1).numpy())
    sims, idx = index.search(F.normalize(queries, dim=1).numpy(), k)
    knn_sims, knn_idx = next(knn_search(tr["features"], va["features"], k, backend="faiss", chunk_size=10**6))
    assert np.array_equal(idx, knn_idx.numpy())
    # ... and the votes of those neighbours give `ssl-xcit knn --backend faiss`'s accuracy exactly.
    scores = knn_votes(torch.from_numpy(sims), tr["labels"][torch.from_numpy(idx)], [k], 0.07, 5)[k]
    top1 = 100.0 * int((scores.argmax(1) == va["labels"]).sum()) / len(va["labels"])
    faiss_run = main(["knn", *small_args(train, val, run_dir / "cache"), "--backend", "faiss", "--k", str(k)])
    assert top1 == faiss_run["results"][str(k)]["top1"]


def _eval():
    from ssl_xcit.data.transforms import eval_transform

    return eval_transform(resize=RESIZE, crop=CROP)


def test_npz_is_plain_arrays_and_the_corrupt_image_is_skipped_and_named(tiny_npz, tiny_tree, capsys):
    summary, path = tiny_npz
    broken = str(tiny_tree / "rose" / "broken.jpg")
    with np.load(path, allow_pickle=False) as data:
        assert sorted(data.files) == ["classes", "embeddings", "labels", "meta", "paths", "skipped"]
        assert data["embeddings"].dtype == np.float32 and data["embeddings"].shape == (6, 128)
        assert data["paths"].tolist() == [
            str(p) for p in sorted(tiny_tree.glob("*/*.jpg")) if p.name != "broken.jpg"
        ]
        assert data["labels"].tolist() == [0, 0, 0, 1, 1, 1]
        assert data["classes"].tolist() == ["daisy", "rose"]
        assert data["skipped"].tolist() == [broken]
        meta = json.loads(str(data["meta"]))
    assert meta["num_images"] == 7 and meta["num_skipped"] == 1 and meta["feature"] == "cls"
    assert summary["skipped"] == [broken]


def test_summary_is_one_line_naming_the_skipped_file(tiny_tree, tmp_path, capsys):
    with pytest.warns(UserWarning, match="broken.jpg"):
        main(embed_args(tiny_tree, tmp_path / "e.pt", tmp_path / "cache"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("embedded 6 of 7 images") and "skipped 1 unreadable: " in lines[0]
    assert str(tiny_tree / "rose" / "broken.jpg") in lines[0]


@pytest.mark.parametrize("suffix", [".csv", ".pt"])
def test_csv_and_pt_give_back_the_npz_rows(tiny_npz, tiny_tree, tmp_path, suffix):
    _, npz = tiny_npz
    out = tmp_path / f"emb{suffix}"
    # the same cache folder: a hit, so the rows are the npz's very features
    summary = main(embed_args(tiny_tree, out, npz.parent / "cache"))
    assert summary["feature_cache_hit"]
    reference, back = read_embeddings(npz), read_embeddings(out)
    assert torch.equal(back["embeddings"], reference["embeddings"])
    assert back["paths"] == reference["paths"] and back["classes"] == reference["classes"]
    assert torch.equal(back["labels"], reference["labels"]) and back["skipped"] == reference["skipped"]
    assert back["meta"] == {**reference["meta"], "feature_cache_hit": True}
    if suffix == ".pt":
        raw = torch.load(out, weights_only=True)
        assert torch.equal(raw["embeddings"], reference["embeddings"])
    else:
        header = out.read_text().splitlines()[0].split(",")
        assert header[:3] == ["path", "label", "e0"] and len(header) == 2 + 128
        assert out.read_text().splitlines()[4].split(",")[1] == "rose"


def test_list_file_without_labels(tiny_tree, tmp_path):
    listed = sorted((tiny_tree / "daisy").glob("*.jpg"))[:2]
    (tmp_path / "list.txt").write_text("".join(f"{p}\n" for p in listed))
    main(embed_args(tmp_path / "list.txt", tmp_path / "e.npz", tmp_path / "cache"))
    with np.load(tmp_path / "e.npz", allow_pickle=False) as data:
        assert "labels" not in data.files and "classes" not in data.files
        assert data["paths"].tolist() == [str(p) for p in listed]
    main(embed_args(tmp_path / "list.txt", tmp_path / "e.csv", tmp_path / "cache"))
    assert (tmp_path / "e.csv").read_text().splitlines()[0].split(",")[:2] == ["path", "e0"]


def test_features_patch_both_and_normalize(tiny_tree, tmp_path, tiny_npz):
    _, cls_path = tiny_npz
    cache = cls_path.parent / "cache"
    rows = {}
    for feature in ("patch", "both"):
        main(embed_args(tiny_tree, tmp_path / f"{feature}.npz", cache, "--feature", feature))
        rows[feature] = read_embeddings(tmp_path / f"{feature}.npz")["embeddings"]
    cls = read_embeddings(cls_path)["embeddings"]
    assert rows["patch"].shape == (6, 128) and rows["both"].shape == (6, 256)
    # both = [CLS | pooled patches]: the pooled part is the same computation; the CLS part comes from
    # get_intermediate_cls instead of forward, equal up to rounding.
    assert torch.equal(rows["both"][:, 128:], rows["patch"])
    torch.testing.assert_close(rows["both"][:, :128], cls, rtol=1e-5, atol=1e-5)
    main(embed_args(tiny_tree, tmp_path / "n.npz", cache, "--normalize"))
    normed = read_embeddings(tmp_path / "n.npz")
    assert torch.equal(normed["embeddings"], F.normalize(cls, dim=1)) and normed["meta"]["normalized"]


def test_existing_output_is_refused_before_any_work(tiny_npz, tiny_tree, monkeypatch):
    _, path = tiny_npz
    before = path.read_bytes()
    import ssl_xcit.evaluation.embeddings as embeddings

    monkeypatch.setattr(embeddings, "dataset_features", lambda *a, **k: pytest.fail("extracted anyway"))
    with pytest.raises(UserError, match=f"{path} exists; pass --overwrite"):
        main(embed_args(tiny_tree, path, path.parent / "cache"))
    assert path.read_bytes() == before


class DiskFull(OSError):
    pass


def _partial_write(*args, **kwargs):
    """Stands in for np.savez / torch.save / the CSV writer: writes part of the file, then fails as a full disk
    or a kill would."""
    handle = next(a for a in args if hasattr(a, "write"))
    handle.write(b"partial" if "b" in handle.mode else "partial")
    raise DiskFull("no space left on device")


@pytest.mark.parametrize(
    "suffix, writer",
    [(".npz", (np, "savez")), (".csv", (embedding_files, "_write_csv")), (".pt", (torch, "save"))],
)
def test_a_failure_mid_write_leaves_no_output_and_keeps_an_old_one(
    tiny_tree, tiny_npz, tmp_path, monkeypatch, suffix, writer
):
    cache, out = tiny_npz[1].parent / "cache", tmp_path / f"emb{suffix}"
    monkeypatch.setattr(*writer, _partial_write)
    with pytest.raises(DiskFull):
        main(embed_args(tiny_tree, out, cache))
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither OUT, nor a sidecar, nor a temporary
    out.write_bytes(b"old")
    with pytest.raises(DiskFull):
        main(embed_args(tiny_tree, out, cache, "--overwrite"))
    assert out.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_bad_arguments_are_one_line_errors(tiny_tree, tmp_path):
    with pytest.raises(UserError, match=r"emb\.parquet: its extension must be one of \.npz, \.csv, \.pt"):
        main(embed_args(tiny_tree, tmp_path / "emb.parquet", tmp_path / "cache"))
    with pytest.raises(UserError, match="--n-last-blocks 2 picks CLS embeddings, but --feature patch"):
        main(
            embed_args(
                tiny_tree, tmp_path / "e.npz", tmp_path / "c", "--feature", "patch", "--n-last-blocks", "2"
            )
        )
    assert not (tmp_path / "e.npz").exists()


@pytest.mark.slow  # ~10 s of 2-process start-up
@pytest.mark.distributed
def test_two_processes_write_the_one_process_rows_once(tiny_tree, tmp_path):
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    env |= {"PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    # Lightning starts the second process itself (DDP on CPU, gloo); batch 1 makes each image's forward the
    # same computation in both runs.
    args = embed_args(tiny_tree, tmp_path / "ddp.npz", tmp_path / "c2", "--batch-size", "1", "--no-cache")
    args[args.index("--devices") + 1] = "2"
    proc = subprocess.run(
        [sys.executable, "-m", "ssl_xcit", *args], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [line for line in proc.stdout.splitlines() if line.startswith("embedded ")]
    assert len(summaries) == 1 and "skipped 1 unreadable" in summaries[0], proc.stdout
    with pytest.warns(UserWarning, match="broken.jpg"):
        main(embed_args(tiny_tree, tmp_path / "one.npz", tmp_path / "c1", "--batch-size", "1", "--no-cache"))
    two, one = read_embeddings(tmp_path / "ddp.npz"), read_embeddings(tmp_path / "one.npz")
    assert two["paths"] == one["paths"] and two["skipped"] == one["skipped"] == [
        str(tiny_tree / "rose" / "broken.jpg")
    ]
    assert torch.equal(two["embeddings"], one["embeddings"]) and torch.equal(two["labels"], one["labels"])
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".npz") == ["ddp.npz", "one.npz"]
