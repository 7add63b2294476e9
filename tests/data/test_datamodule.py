from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image

from ssl_xcit.data import datamodule as dm_module
from ssl_xcit.data.datamodule import DINODataModule, SkippedImagesLogger
from ssl_xcit.data.resumable import ResumableSampler
from ssl_xcit.data.synthetic import ensure_synthetic_dataset

SMALL_CROPS = dict(
    global_crops_size=16,
    local_crops_size=8,
    local_crops_number=2,
    eval_resize=16,
    eval_crop=16,
    num_workers=0,
)


def make_tree(root: Path, classes=("ant", "bee"), per_class=6, size=24) -> Path:
    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


def test_end_to_end_on_a_tiny_imagefolder(tmp_path):
    dm = DINODataModule(
        root=str(make_tree(tmp_path / "data")), val_fraction=0.34, batch_size=4, **SMALL_CROPS
    )
    dm.setup("fit")
    assert len(dm.train_dataset) == 8 and len(dm.val_dataset) == 4 and dm.num_crops == 4
    loader = dm.train_dataloader()
    # Shuffled by the resumable sampler (ssl_xcit.data.resumable), which Lightning checkpoints.
    assert loader.drop_last and isinstance(loader.sampler, ResumableSampler) and loader.sampler.shuffle
    assert loader.batch_size == 4 and (loader.sampler.num_replicas, loader.sampler.rank) == (1, 0)
    assert not loader.persistent_workers  # only with workers
    crops, labels, indices = next(iter(loader))
    assert [tuple(c.shape) for c in crops] == [(4, 3, 16, 16)] * 2 + [(4, 3, 8, 8)] * 2
    assert labels.dtype == torch.int64 and set(labels.tolist()) <= {0, 1} and len(set(indices.tolist())) == 4
    assert len(loader) == 2

    bank, queries = dm.knn_datasets()
    assert dm.knn_unavailable_reason is None
    assert bank.classes == queries.classes == ["ant", "bee"]
    assert Counter(bank.targets) == {0: 4, 1: 4} and Counter(queries.targets) == {0: 2, 1: 2}
    assert not {p for p, _ in bank.samples} & {p for p, _ in queries.samples}
    image, label, _ = queries[0]
    assert image.shape == (3, 16, 16) and label == queries.targets[0]


def test_separate_val_root_is_aligned_by_class_name(tmp_path):
    train = make_tree(tmp_path / "train", classes=("ant", "bee", "cat"), per_class=2)
    val = make_tree(tmp_path / "val", classes=("bee", "cat"), per_class=1)
    dm = DINODataModule(root=str(train), val_root=str(val), batch_size=2, knn_bank_limit=3, **SMALL_CROPS)
    bank, queries = dm.knn_datasets()
    assert queries.targets == [1, 2] and len(bank) == 3 and set(bank.targets) == {0, 1, 2}
    odd = make_tree(tmp_path / "odd", classes=("bee", "dog"), per_class=1)
    with pytest.raises(ValueError, match=r"classes absent from the training data: \['dog'\]"):
        DINODataModule(root=str(train), val_root=str(odd), batch_size=2, **SMALL_CROPS).setup("fit")


def test_unlabelled_data_disables_knn_with_a_reason(tmp_path):
    flat = tmp_path / "flat"
    make_tree(flat, classes=("x",), per_class=4)
    # A loose image: the folder is no longer an ImageFolder tree.
    Image.new("RGB", (24, 24)).save(flat / "loose.png")
    dm = DINODataModule(root=str(flat), batch_size=2, **SMALL_CROPS)
    assert dm.knn_datasets() is None and "no labels" in dm.knn_unavailable_reason
    crops, labels, _ = next(iter(dm.train_dataloader()))
    assert labels.tolist() == [-1, -1] and len(crops) == 4
    labelled = DINODataModule(root=str(make_tree(tmp_path / "tree")), batch_size=2, **SMALL_CROPS)
    assert labelled.knn_datasets() is None and "val_root" in labelled.knn_unavailable_reason
    assert dm.heldout_dataset() is None  # no val set: nothing for the label-free monitor either


def test_unlabelled_val_fraction_holds_out_images_for_the_label_free_monitor(tmp_path):
    """Unlabelled data with val_fraction: a seeded hold-out of all images, never trained on, served with the
    eval transform by heldout_dataset(); the k-NN stays off (no labels)."""
    flat = tmp_path / "flat"
    make_tree(flat, classes=("x",), per_class=9)
    Image.new("RGB", (24, 24)).save(flat / "loose.png")  # not an ImageFolder tree: unlabelled
    dm = DINODataModule(root=str(flat), val_fraction=0.2, batch_size=2, eval_resize=16, eval_crop=16)
    held = dm.heldout_dataset()
    assert len(held) == 2 and len(dm.train_dataset) == 8 and dm.knn_datasets() is None
    assert not {p for p, _ in held.samples} & {p for p, _ in dm.train_dataset.samples}
    image, label = held[0][:2]
    assert tuple(image.shape) == (3, 16, 16) and label == -1
    again = DINODataModule(root=str(flat), val_fraction=0.2, batch_size=2).heldout_dataset()
    assert again.samples == held.samples  # the split is fixed by split_seed


def test_bad_roots_fail_before_training(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data.root .*nowhere does not exist"):
        DINODataModule(root=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="data.val_root"):
        DINODataModule(root=str(make_tree(tmp_path / "ok")), val_root=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is empty"):
        DINODataModule(root=str(tmp_path / "empty"), **SMALL_CROPS).setup("fit")
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("x")
    with pytest.raises(ValueError, match=r"no images found .*accepted extensions"):
        DINODataModule(root=str(tmp_path / "texts"), **SMALL_CROPS).setup("fit")
    with pytest.raises(ValueError, match="fewer than batch_size=64"):
        DINODataModule(root=str(tmp_path / "ok"), batch_size=64, **SMALL_CROPS).setup("fit")
    with pytest.raises(ValueError, match="val_fraction"):
        DINODataModule(val_fraction=1.0)
    with pytest.raises(ValueError, match="not both"):
        DINODataModule(root=str(tmp_path / "ok"), val_root=str(tmp_path / "ok"), val_fraction=0.1)
    with pytest.raises(ValueError, match="local_crops_scale"):
        DINODataModule(local_crops_scale=(0.5, 0.1))


def test_builtin_synthetic_default(monkeypatch):
    # The full default set takes ~10 s to generate; the wiring is the same with a small one.
    monkeypatch.setattr(
        dm_module,
        "ensure_synthetic_dataset",
        lambda: ensure_synthetic_dataset(num_train_per_class=4, num_val_per_class=2),
    )
    dm = DINODataModule(batch_size=8, **SMALL_CROPS)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_dataset) == 40 and len(dm.train_dataset.classes) == 10
    bank, queries = dm.knn_datasets()
    assert len(bank) == 40 and len(queries) == 20 and queries.classes == bank.classes
    crops, _, _ = next(iter(dm.train_dataloader()))
    assert crops[0].shape == (8, 3, 16, 16) and crops[-1].shape == (8, 3, 8, 8)


class _TinyModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        if batch is None:
            return None
        crops, _, _ = batch
        return self.layer(crops[0].mean((2, 3))).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_skipped_images_are_counted_and_logged(tmp_path):
    root = make_tree(tmp_path / "data", classes=("a", "b"), per_class=4)
    (root / "a" / "broken.png").write_bytes(b"\x89PNG not really")
    dm = DINODataModule(root=str(root), batch_size=3, **SMALL_CROPS)
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SkippedImagesLogger()],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_TinyModule(), datamodule=dm)
    assert dm.num_skipped == 1
    assert float(trainer.callback_metrics["data/skipped_images"]) == 1.0
    messages = [str(w.message) for w in caught]
    # Warned once, not once per epoch.
    assert sum("skipping unreadable image" in m and "broken.png" in m for m in messages) == 1
    assert any("1 unreadable image(s) were skipped" in m for m in messages)


def test_flowers5_fixed_split(shared_data):
    kwargs = dict(root=str(shared_data / "flowers5"), val_fraction=0.2, batch_size=2, **SMALL_CROPS)
    dm = DINODataModule(**kwargs)
    dm.setup("fit")
    assert len(dm.train_dataset) + len(dm.val_dataset) == 4317
    assert Counter(dm.val_dataset.targets) == {0: 153, 1: 210, 2: 157, 3: 147, 4: 197}
    again = DINODataModule(**kwargs)
    again.setup("fit")
    assert again.val_dataset.samples == dm.val_dataset.samples
    crops, labels, _ = next(iter(dm.train_dataloader()))
    assert len(crops) == 4 and crops[0].shape == (2, 3, 16, 16)


def test_verify_images_count_is_the_readable_one(tmp_path, caplog):
    import logging

    root = make_tree(tmp_path / "data", per_class=8)
    for name in ("ant/0.png", "bee/1.png"):
        (root / name).write_bytes(b"not an image")
    dm = DINODataModule(root=str(root), batch_size=4, verify_images=True, **SMALL_CROPS)
    with caplog.at_level(logging.INFO), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one warning per unreadable file, tested elsewhere
        dm.setup("fit")
    assert "verify_images: 2 of 16 training images are unreadable" in caplog.text
    assert "DINO data: 14 training images (2 classes; 2 unreadable skipped)" in caplog.text


def test_blur_radius_reaches_every_crop_and_is_checked(tmp_path):
    root = str(make_tree(tmp_path / "data"))
    device = DINODataModule(root=root, blur_radius=(0.03, 0.57), **SMALL_CROPS)
    assert device.crop_config["blur_radius"] == device.photometric.blur_radius == (0.03, 0.57)
    dm = DINODataModule(root=root, blur_radius=(0.03, 0.57), augment_on="cpu", **SMALL_CROPS)
    assert dm.train_transform.config["blur_radius"] == (0.03, 0.57)
    pipelines = [*dm.train_transform.global_transforms, dm.train_transform.local_transform]
    blurs = [t for p in pipelines for t in _flatten(p) if type(t).__name__ == "GaussianBlur"]
    assert len(blurs) == 3 and all(b.radius == (0.03, 0.57) for b in blurs)  # 2 global + the local pipeline
    with pytest.raises(ValueError, match=r"blur radius must be \(min, max\).*\(2\.0, 0\.1\)"):
        DINODataModule(root=root, blur_radius=(2.0, 0.1), **SMALL_CROPS)


def _flatten(transform):
    inner = getattr(transform, "transforms", None)
    if inner is None:
        return [transform]
    return [t for child in inner for t in _flatten(child)]
