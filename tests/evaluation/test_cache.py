"""Feature cache: round trip, exact-meta matching, unreadable files, fingerprints."""

from __future__ import annotations

import os

import pytest
import torch

from ssl_xcit.evaluation.cache import (
    cache_path,
    checkpoint_fingerprint,
    files_fingerprint,
    load_cached,
    precision_key,
    save_cached,
)

META = {
    "checkpoint_sha256": "ab" * 32,
    "arch": "xcit_nano_12_p16",
    "transform": "T",
    "files": "f",
    "feature": "cls1",
}


def test_round_trip_and_exact_meta(tmp_path):
    tensors = {"features": torch.randn(4, 3), "labels": torch.tensor([0, 1, 1, 0])}
    path = save_cached(tmp_path, "train", META, tensors)
    assert path.is_file() and path == cache_path(tmp_path, "train", META)
    got = load_cached(tmp_path, "train", dict(META))
    assert got is not None
    torch.testing.assert_close(got["features"], tensors["features"])
    assert got["labels"].tolist() == [0, 1, 1, 0]
    # Any changed field, an extra field, or another split name is a miss.
    for changed in ({**META, "arch": "xcit_tiny_12_p16"}, {**META, "files": "g"}, {**META, "extra": 1}):
        assert load_cached(tmp_path, "train", changed) is None
    assert load_cached(tmp_path, "val", META) is None
    # No temporary files are left behind by the atomic write.
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_meta_with_same_hash_prefix_but_different_content_is_a_miss(tmp_path):
    path = save_cached(tmp_path, "train", META, {"x": torch.ones(1)})
    # Simulate a file whose name matches but whose stored meta does not (e.g. a hash-prefix collision).
    entry = torch.load(path, weights_only=True)
    entry["meta"]["arch"] = "other"
    torch.save(entry, path)
    assert load_cached(tmp_path, "train", META) is None


def test_unreadable_cache_file_is_a_miss_with_warning(tmp_path):
    path = cache_path(tmp_path, "train", META)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"truncated")
    with pytest.warns(UserWarning, match="ignoring unreadable feature cache"):
        assert load_cached(tmp_path, "train", META) is None


def test_files_fingerprint_tracks_list_size_mtime_and_labels(tmp_path):
    files = []
    for i in range(3):
        f = tmp_path / f"{i}.jpg"
        f.write_bytes(b"x" * (i + 1))
        files.append(f)
    base = files_fingerprint(files, [0, 1, 2])
    assert files_fingerprint(files, [0, 1, 2]) == base
    assert files_fingerprint(files[:2], [0, 1]) != base  # removed file
    assert files_fingerprint(files, [0, 1, 1]) != base  # relabelled
    st = os.stat(files[0])
    os.utime(files[0], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert files_fingerprint(files, [0, 1, 2]) != base  # rewritten (mtime)
    touched = files_fingerprint(files, [0, 1, 2])
    files[1].write_bytes(b"yyyyy")
    os.utime(files[1], ns=(os.stat(files[1]).st_atime_ns, os.stat(files[1]).st_mtime_ns))
    assert files_fingerprint(files, [0, 1, 2]) != touched  # size changed


def test_checkpoint_fingerprint(tmp_path):
    assert checkpoint_fingerprint(None) is None
    f = tmp_path / "w.pth"
    f.write_bytes(b"abc")
    assert checkpoint_fingerprint(f) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    with pytest.raises(FileNotFoundError, match="weights file not found: .*missing.pth"):
        checkpoint_fingerprint(tmp_path / "missing.pth")


def test_precision_key_canonical_names_and_matmul_mode():
    assert precision_key(None) == precision_key("32") == precision_key(32) == precision_key("32-true")
    assert precision_key("bf16") == precision_key("bf16-mixed") != precision_key(None)
    assert precision_key("16-mixed") not in (precision_key(None), precision_key("bf16-mixed"))
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        strict = precision_key(None)
        torch.set_float32_matmul_precision("high")  # TF32 matmuls: other numbers, other key
        assert precision_key(None) != strict
    finally:
        torch.set_float32_matmul_precision(previous)


def test_code_fingerprint_changes_with_model_source(tmp_path, monkeypatch):
    from ssl_xcit.evaluation import cache

    package = tmp_path / "fakemodels"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "net.py").write_text("SCALE = 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cache, "_MODEL_CODE_PACKAGES", ("fakemodels",))
    cache.code_fingerprint.cache_clear()
    try:
        before = cache.code_fingerprint()
        assert cache.code_fingerprint() == before
        (package / "net.py").write_text("SCALE = 2.0\n")
        cache.code_fingerprint.cache_clear()
        assert cache.code_fingerprint() != before
    finally:
        cache.code_fingerprint.cache_clear()
