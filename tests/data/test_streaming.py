"""Training on prepared shards (``ssl_xcit.data.streaming``): the datamodule's streaming loader, unreadable
records, the val/k-NN sets, and the one-line errors. The resume and 2-process cases are in
tests/dino/test_resume.py; the CLI runs in tests/cli/test_shards_cli.py."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch

from ssl_xcit.data.datamodule import DINODataModule, SkippedImagesLogger
from ssl_xcit.data.datasets import collate_train
from ssl_xcit.data.device_crops import CropBatch
from ssl_xcit.data.streaming import ShardCrops, ShardLoader, ShardTrainSet, shard_train_loader
from ssl_xcit.errors import UserError

from .shard_helpers import make_shards
from .test_datamodule import SMALL_CROPS, _TinyModule


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    return make_shards(root / "train", 20), make_shards(root / "val", 6)


def _size(image) -> torch.Tensor:
    return torch.tensor(image.size)


def _ids(loader) -> list[int]:
    return [i for batch in loader for i in batch[2].tolist()]


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_is_every_kept_record_once_and_the_next_is_reshuffled(shards, workers):
    """20 records, batch 3, one process: drop_last keeps floor(20 / 3) = 6 full batches, 18 records."""
    data = ShardTrainSet(shards[0], _size, seed=5)
    loader = shard_train_loader(data, 3, collate_train, num_workers=workers, seed=5)
    first, second = _ids(loader), _ids(loader)
    assert len(loader) == 6
    for epoch in (first, second):
        assert len(epoch) == len(set(epoch)) == 18 and set(epoch) <= set(range(20))
    assert first != second
    again = shard_train_loader(ShardTrainSet(shards[0], _size, seed=5), 3, collate_train, num_workers=workers)
    assert _ids(again) == first  # the order is the seed's


@pytest.mark.parametrize("augment_on", ["cpu", "device"])
def test_datamodule_trains_on_shards_and_counts_an_unreadable_record(tmp_path, augment_on):
    root = make_shards(tmp_path / "train", 12, bad=(4,))
    dm = DINODataModule(root=str(root), batch_size=3, augment_on=augment_on, **SMALL_CROPS)
    trainer = L.Trainer(
        max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[SkippedImagesLogger()],
    )  # fmt: skip
    batches = []

    class Spy(_TinyModule):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            return batch

        def training_step(self, batch, batch_idx):
            batches.append(batch)
            return super().training_step(batch, batch_idx)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Spy(), datamodule=dm)
    assert isinstance(dm.train_dataset, ShardTrainSet) and isinstance(trainer.train_dataloader, ShardLoader)
    assert len(batches) == 8  # 4 full batches a epoch
    crops = batches[0][0]
    assert [tuple(c.shape) for c in crops] == [(3, 3, 16, 16)] * 2 + [(3, 3, 8, 8)] * 2
    assert crops[0].dtype == torch.float32  # device crops went through the batched half, cpu through PIL
    for epoch in (batches[:4], batches[4:]):  # 12 records in 4 full batches; record 4 dropped from its batch
        seen = [i for b in epoch for i in b[2].tolist()]
        assert sorted(seen) == [i for i in range(12) if i != 4]
    assert dm.num_skipped == 1 and float(trainer.callback_metrics["data/skipped_images"]) == 1.0
    messages = [str(w.message) for w in caught]
    assert sum("skipping unreadable record 4 (0004.jpg)" in m for m in messages) == 1  # once, not per epoch
    assert any("1 unreadable image(s) were skipped on this rank, e.g. 0004.jpg" in m for m in messages)


def test_device_crops_read_record_bytes(shards):
    dm = DINODataModule(
        root=str(shards[0]), batch_size=4, augment_on="device", decode_on="device", **SMALL_CROPS
    )
    dm.setup("fit")
    crops, labels, indices = next(iter(dm.train_dataloader()))
    assert isinstance(crops, CropBatch) and len(crops.encoded) == 4  # bytes kept for the batched decode
    assert labels.tolist() == [i % 2 for i in indices.tolist()]


def test_val_and_knn_sets_from_prepared_val_images(shards):
    dm = DINODataModule(
        root=str(shards[0]), val_root=str(shards[1]), batch_size=4, knn_bank_limit=6, **SMALL_CROPS
    )
    dm.setup("fit")
    bank, queries = dm.knn_datasets()
    assert isinstance(bank, ShardCrops) and len(bank) == 6 and sorted(bank.targets) == [0, 0, 0, 1, 1, 1]
    assert [int(p.stem) % 2 for p, _ in bank.samples] == bank.targets  # record i has label i % 2
    image, label, index = queries[3]
    assert image.shape == (3, 16, 16) and (label, index) == (1, 3)
    crops, labels, _ = next(iter(dm.val_dataloader()))
    assert len(crops) == 4 and labels.tolist() == [0, 1, 0, 1]


@pytest.mark.parametrize("decode_on", ["worker", "device"])
def test_val_loss_batches_of_device_crops_read_record_bytes(shards, decode_on):
    dm = DINODataModule(
        root=str(shards[0]), val_root=str(shards[1]), batch_size=4, augment_on="device", decode_on=decode_on,
        **SMALL_CROPS,
    )  # fmt: skip
    dm.setup("fit")
    crops, labels, indices = next(iter(dm.val_dataloader()))
    assert isinstance(crops, CropBatch) and crops.batch_size == 4 and indices.tolist() == [0, 1, 2, 3]
    assert len(crops.encoded) == (4 if decode_on == "device" else 0)


def test_val_classes_are_mapped_to_the_training_classes(tmp_path):
    train = make_shards(tmp_path / "train", 8, classes=["a", "b", "c"])
    val = make_shards(tmp_path / "val", 4, classes=["b", "c"])
    dm = DINODataModule(root=str(train), val_root=str(val), batch_size=2, **SMALL_CROPS)
    dm.setup("fit")
    assert [dm.val_dataset[i][1] for i in range(4)] == [1, 2, 1, 2]


def test_val_fraction_and_verify_images_are_refused_on_shards(shards):
    with pytest.raises(
        UserError, match=r"val_fraction=0.2 is not available with a prepared dataset .*val_root"
    ):
        DINODataModule(root=str(shards[0]), val_fraction=0.2, **SMALL_CROPS).setup("fit")
    with pytest.raises(UserError, match=r"verify_images decodes image files; .* is a prepared dataset"):
        DINODataModule(root=str(shards[0]), verify_images=True, **SMALL_CROPS).setup("fit")


def test_a_changed_split_is_refused_on_resume_naming_the_values(shards):
    data = ShardTrainSet(shards[0], _size, seed=5)
    loader = shard_train_loader(data, 3, collate_train, seed=5)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    other = shard_train_loader(ShardTrainSet(shards[0], _size, seed=6), 2, collate_train, seed=6)
    with pytest.raises(UserError, match=r"saved mid-epoch with batch_size=3, seed=5 but this run has batch_size=2, "
                       r"seed=6: the rest of that epoch"):  # fmt: skip
        other.load_state_dict(state)
    same = shard_train_loader(ShardTrainSet(shards[0], _size, seed=5), 3, collate_train, seed=5)
    same.load_state_dict(state)
    assert len(_ids(same)) == 15  # the 5 batches after the first


def test_a_url_root_is_accepted_until_it_is_read():
    """No existence check for ``s3://`` (tests/cli/test_object_storage.py reads one from a server)."""
    dm = DINODataModule(root="s3://bucket/imagenet-shards", **SMALL_CROPS)
    assert dm.hparams.root == "s3://bucket/imagenet-shards"
    with pytest.raises(UserError, match="storage options: unknown key.s. endpoint; valid: endpoint_url"):
        DINODataModule(root="s3://bucket/imagenet-shards", storage_options={"endpoint": "x"}, **SMALL_CROPS)


def test_labels_are_ignored_when_asked(shards):
    dm = DINODataModule(root=str(shards[0]), labelled=False, batch_size=4, **SMALL_CROPS)
    dm.setup("fit")
    _, labels, _ = next(iter(dm.train_dataloader()))
    assert dm.train_dataset.classes is None and labels.tolist() == [-1] * 4
    assert dm.knn_datasets() is None and "no labels" in dm.knn_unavailable_reason
