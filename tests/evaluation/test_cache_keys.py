"""The feature-cache key holds everything that determines the features: library versions, our decoding and
resizing code, and the module itself when one is passed (not the ``weights`` argument beside it)."""

from __future__ import annotations

import copy
import importlib
import sys

import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from ssl_xcit.data import image_dataset
from ssl_xcit.data.datasets import build_dataset
from ssl_xcit.data.transforms import eval_transform
from ssl_xcit.evaluation import cache as feature_cache
from ssl_xcit.evaluation.cached import dataset_features
from ssl_xcit.evaluation.features import FeatureConfig
from ssl_xcit.evaluation.keys import feature_meta
from ssl_xcit.models import create_model

from .helpers import ARCH

EXTRACT = dict(batch_size=4, num_workers=0, accelerator="cpu", devices=1, progress=False)


@pytest.fixture
def folder(tmp_path):
    """2 classes x 2 tiny generated images."""
    gen = torch.Generator().manual_seed(0)
    for c in ("a", "b"):
        (tmp_path / "imgs" / c).mkdir(parents=True)
        for i in range(2):
            pixels = torch.randint(0, 255, (40, 40, 3), generator=gen, dtype=torch.uint8).numpy()
            Image.fromarray(pixels).save(tmp_path / "imgs" / c / f"{i}.png")
    return tmp_path / "imgs"


def _key(dataset, **kwargs) -> str:
    meta = feature_meta(dataset, weights=None, arch=ARCH, config=FeatureConfig(), **kwargs)
    return feature_cache.cache_path("/cache", "train", meta).name


@pytest.mark.parametrize("library", ["torch", "torchvision", "PIL", "timm"])
def test_the_key_changes_with_each_library_version(library, folder, monkeypatch):
    dataset = build_dataset(folder, transform=eval_transform(resize=32, crop=32))
    before = _key(dataset)
    monkeypatch.setattr(sys.modules[library], "__version__", "999.0")
    assert _key(dataset) != before


def test_the_key_changes_with_the_decoding_code(folder, monkeypatch):
    dataset = build_dataset(folder, transform=eval_transform(resize=32, crop=32))
    before = _key(dataset)
    original = image_dataset.load_image

    def load_image(path, exif_transpose=True, draft=None):  # what ImageDataset.__getitem__ now calls
        return original(path, exif_transpose=False, draft=draft)

    monkeypatch.setattr(image_dataset, "load_image", load_image)
    assert _key(dataset) != before


def test_the_key_changes_with_our_resizing_code(folder, tmp_path, monkeypatch):
    """A transform of our own with the same repr but other code is another key; library transforms (keyed by
    version) are not hashed by source."""
    module = tmp_path / "pkg_resize" / "ours.py"
    module.parent.mkdir()
    (module.parent / "__init__.py").write_text("")
    code = "class Shrink:\n    def __call__(self, x):\n        return x.resize((x.width // {d}, x.height // {d}))\n"
    module.write_text(code.format(d=2))
    monkeypatch.syspath_prepend(str(tmp_path))
    ours = importlib.import_module("pkg_resize.ours")

    def key() -> str:
        transform = v2.Compose([ours.Shrink(), v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True)])
        return _key(build_dataset(folder, transform=transform))

    before = key()
    assert key() == before
    module.write_text(code.format(d=4))  # same class, same repr, other resizing
    importlib.reload(ours)
    assert key() != before
    monkeypatch.delitem(sys.modules, "pkg_resize.ours")
    monkeypatch.delitem(sys.modules, "pkg_resize")


def test_a_module_is_keyed_on_its_tensors_not_on_the_weights_argument(folder, tmp_path):
    dataset = build_dataset(folder, transform=eval_transform(resize=32, crop=32))
    weights = tmp_path / "w.pth"
    torch.manual_seed(1)
    first = create_model(ARCH).eval()
    torch.save(first.state_dict(), weights)
    torch.manual_seed(2)
    second = create_model(ARCH).eval()  # other weights, handed over with the same `weights` argument

    def run(model):
        return dataset_features(
            dataset, "train", weights=weights, arch=ARCH, cache_dir=tmp_path / "c", model=model, **EXTRACT
        )

    a, hit = run(first)
    assert not hit
    b, hit = run(second)
    assert not hit  # before: a hit, serving the first module's features
    assert not torch.allclose(a["features"], b["features"])
    again, hit = run(first)
    assert hit and torch.equal(again["features"], a["features"])

    with torch.no_grad():
        first.norm.weight.mul_(2.0)  # the same module object, changed in place
    _, hit = run(first)
    assert not hit


def test_module_fingerprint_sees_class_structure_and_every_tensor():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    base = feature_cache.module_fingerprint(model)
    assert feature_cache.module_fingerprint(model) == base
    moved = copy.deepcopy(model)
    moved[1].running_mean += 1  # a buffer, not a parameter
    assert feature_cache.module_fingerprint(moved) != base
    same_tensors = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4, eps=1e-3))
    same_tensors.load_state_dict(model.state_dict())
    assert feature_cache.module_fingerprint(same_tensors) != feature_cache.module_fingerprint(model)  # eps
    assert feature_cache.module_fingerprint(copy.deepcopy(model).to(torch.bfloat16)) != base  # dtype
