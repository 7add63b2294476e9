"""Feature extraction: equivalence with a direct forward, corrupt images, and cache reuse/invalidation."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from ssl_xcit.data.datasets import ImageDataset, build_dataset
from ssl_xcit.data.transforms import eval_transform
from ssl_xcit.evaluation.cached import dataset_features
from ssl_xcit.evaluation.features import FeatureConfig, compute_features
from ssl_xcit.models import create_model

from .helpers import ARCH, CROP, RESIZE

EXTRACT = dict(batch_size=4, num_workers=0, accelerator="cpu", devices=1, progress=False)


@pytest.fixture
def tiny_folder(shared_data: Path, tmp_path) -> Path:
    """6 real photos (copied, so tests may touch them) in 2 classes, plus one corrupt file in class "b"."""
    src = build_dataset(shared_data / "flowers5")
    root = tmp_path / "tiny"
    for i, (path, _label) in enumerate(src.samples[::700][:6]):
        dest = root / ("a" if i % 2 == 0 else "b") / f"{i}.jpg"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, dest)
    (root / "b" / "2_corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    return root


class Counter:
    """A backbone factory that counts how often a backbone had to be built (= cache misses)."""

    def __init__(self, weights: Path | None = None):
        self.weights = weights
        self.calls = 0

    def __call__(self):
        self.calls += 1
        torch.manual_seed(0)
        model = create_model(ARCH)
        if self.weights is not None:
            model.load_state_dict(torch.load(self.weights, weights_only=True))
        return model.eval()


def _dataset(root: Path, crop: int = CROP) -> ImageDataset:
    return build_dataset(root, transform=eval_transform(resize=RESIZE, crop=crop))


def test_features_match_direct_forward_and_skip_corrupt(tiny_folder, tmp_path):
    ds = _dataset(tiny_folder)
    assert len(ds) == 7
    bad = next(i for i, (p, _) in enumerate(ds.samples) if "corrupt" in p.name)
    with pytest.warns(UserWarning, match="skipping unreadable image .*2_corrupt.jpg"):
        out, hit = dataset_features(ds, "train", weights=None, arch=ARCH, cache_dir=tmp_path / "c", **EXTRACT)
    assert not hit
    assert out["indices"].tolist() == [i for i in range(7) if i != bad]
    assert out["labels"].tolist() == [ds.samples[i][1] for i in out["indices"].tolist()]
    # Same numbers as a plain forward of the same random-init backbone (seed 0) on the same images.
    torch.manual_seed(0)
    model = create_model(ARCH).eval()
    with torch.no_grad():
        direct = model(torch.stack([ds[i][0] for i in out["indices"].tolist()]))
    torch.testing.assert_close(out["features"], direct, rtol=1e-4, atol=1e-5)


def test_cache_reused_and_invalidated(tiny_folder, tmp_path):
    cache = tmp_path / "cache"
    weights = tmp_path / "w.pth"
    torch.manual_seed(1)
    torch.save(create_model(ARCH).state_dict(), weights)
    ds = _dataset(tiny_folder)

    def run(dataset, factory):
        return dataset_features(
            dataset, "train", weights=weights, arch=ARCH, cache_dir=cache, model=factory, **EXTRACT
        )

    first = Counter(weights)
    with pytest.warns(UserWarning, match="unreadable"):
        a, hit = run(ds, first)
    assert (hit, first.calls) == (False, 1)

    again = Counter(weights)
    b, hit = run(_dataset(tiny_folder), again)
    assert (hit, again.calls) == (True, 0)  # served from disk: no backbone built, no image read
    torch.testing.assert_close(a["features"], b["features"])

    # New checkpoint content at the same path -> miss, and different features.
    torch.manual_seed(2)
    torch.save(create_model(ARCH).state_dict(), weights)
    changed = Counter(weights)
    with pytest.warns(UserWarning, match="unreadable"):
        c, hit = run(_dataset(tiny_folder), changed)
    assert (hit, changed.calls) == (False, 1)
    assert not torch.allclose(c["features"], a["features"])

    # Another transform (crop 48 instead of 64) -> miss.
    other = Counter(weights)
    with pytest.warns(UserWarning, match="unreadable"):
        _, hit = run(_dataset(tiny_folder, crop=48), other)
    assert (hit, other.calls) == (False, 1)

    # A rewritten image (new mtime) -> miss; an added image -> miss.
    img = next((tiny_folder / "a").iterdir())
    st = img.stat()
    os.utime(img, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    touched = Counter(weights)
    with pytest.warns(UserWarning, match="unreadable"):
        _, hit = run(_dataset(tiny_folder), touched)
    assert (hit, touched.calls) == (False, 1)
    shutil.copy(img, tiny_folder / "a" / "extra.jpg")
    added = Counter(weights)
    with pytest.warns(UserWarning, match="unreadable"):
        d, hit = run(_dataset(tiny_folder), added)
    assert (hit, added.calls) == (False, 1) and d["features"].shape[0] == 7

    # The now-current inputs are served from the cache again.
    final = Counter(weights)
    _, hit = run(_dataset(tiny_folder), final)
    assert (hit, final.calls) == (True, 0)


def test_feature_variants_shapes_and_values():
    torch.manual_seed(0)
    model = create_model(ARCH).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        cls = compute_features(model, x)
        both = compute_features(model, x, FeatureConfig(1, True))
        last3 = compute_features(model, x, FeatureConfig(3, True))
        tokens, _ = model.forward_patch_tokens(x)  # the interface's dense tokens
    c = model.embed_dim
    assert both.shape == (2, 2 * c) and last3.shape == (2, 4 * c)
    torch.testing.assert_close(both[:, :c], cls)
    torch.testing.assert_close(both[:, c:], tokens.mean(1))
    torch.testing.assert_close(last3[:, 2 * c : 3 * c], cls, rtol=1e-4, atol=1e-5)  # the last block's CLS
    assert FeatureConfig(3, True).name == "cls3+avgpool"
    with pytest.raises(ValueError, match="n_last_blocks must be >= 1, got 0"):
        FeatureConfig(0)


@pytest.mark.filterwarnings("ignore:.*unreadable")
def test_cache_keyed_on_precision_and_model_code(tiny_folder, tmp_path, monkeypatch):
    """bf16 features must not be served to an fp32 run, nor features of older model code after an upgrade."""
    from ssl_xcit.evaluation import cache as feature_cache

    ds = _dataset(tiny_folder)

    def run(precision=None):
        factory = Counter()
        out, hit = dataset_features(
            ds,
            "train",
            weights=None,
            arch=ARCH,
            cache_dir=tmp_path / "c",
            model=factory,
            **{**EXTRACT, "precision": precision},
        )
        return out, hit, factory.calls

    low, hit, calls = run("bf16-mixed")
    assert (hit, calls) == (False, 1)
    full, hit, calls = run(None)
    assert (hit, calls) == (False, 1)  # the bf16 entry is not served to the fp32 run
    assert not torch.equal(low["features"], full["features"])
    _, hit, calls = run("32-true")
    assert (hit, calls) == (True, 0)  # "32-true" is the default's canonical name: a hit

    # New model code (simulated: another source fingerprint) -> miss.
    monkeypatch.setattr(feature_cache, "code_fingerprint", lambda: "0" * 64)
    _, hit, calls = run(None)
    assert (hit, calls) == (False, 1)
