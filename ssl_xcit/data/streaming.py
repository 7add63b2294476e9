"""Training and monitoring from prepared shards (``ssl-xcit prepare``): LitData's streaming loader.

The training loader is LitData's ``StreamingDataLoader`` over a shuffled ``StreamingDataset``. LitData splits
the epoch's shuffled chunks over global rank x worker; with ``drop_last`` every rank gets the same number of
full batches, and what does not fill ``world_size`` x ``batch_size`` at the end of the epoch's shuffled order is
dropped (at most ``world_size * batch_size - 1`` records an epoch). It reads local folders or ``s3://`` /
``gs://`` URLs, and its ``state_dict`` / ``load_state_dict`` resume an epoch on the records not yet seen.
Lightning saves that state in the checkpoint (it checkpoints any training loader with both methods), so
``--ckpt_path last`` finishes the interrupted epoch with no record repeated and none lost.

Each record goes through the same per-item transform as a file: DINO's PIL multi-crop (``augment_on=cpu``) or
the crop reader (``augment_on=device``, its ``read`` accepts the record's bytes). A record whose bytes do not
decode yields ``None`` (dropped by the collate) and is flagged in a shared-memory tensor of one flag per record,
as ``ImageDataset`` does for files, so ``num_skipped`` in the training process counts the records any worker
met.

Map-style reading (k-NN bank and queries, the val loss) uses ``ShardImageDataset`` (records by index, labels
from the metadata), through :class:`ShardCrops` where the transform is the crop reader.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from litdata import StreamingDataLoader, StreamingDataset
from litdata.streaming.sampler import ChunkedIndex
from torch.utils.data import Dataset

from ssl_xcit.data.datasets import ImageDataset, UnreadableImageWarning
from ssl_xcit.data.shard_dataset import ShardImageDataset
from ssl_xcit.data.shards import decode_image, is_url, read_meta
from ssl_xcit.data.splits import stratified_split
from ssl_xcit.data.storage import litdata_options, storage_errors
from ssl_xcit.errors import UserError


def shard_classes(root: str | Path, storage_options: dict[str, Any] | None = None) -> list[str] | None:
    """The class names of a prepared dataset (local or URL), None when unlabelled."""
    classes = read_meta(root, storage_options).get("classes")
    return list(classes) if classes else None


def _source(root: str | Path) -> str:
    return str(root) if is_url(root) else str(Path(root).expanduser().resolve())


class ShardTrainSet(StreamingDataset):
    """Shuffled, ``drop_last`` records -> ``(transform(image), label, record index)``, split by LitData.

    ``transform``: DINO's PIL multi-crop (applied to the decoded image) or the crop reader (given the bytes).
    """

    def __init__(
        self,
        root: str | Path,
        transform: Callable | None,
        seed: int,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.storage_options = dict(storage_options or {})
        with storage_errors(str(root), self.storage_options):
            super().__init__(
                _source(root), shuffle=True, drop_last=True, seed=seed,
                storage_options=litdata_options(str(root), self.storage_options),
            )  # fmt: skip
        self.root = str(root)
        # Not `self.transform`: StreamingDataset applies that one to the raw record itself.
        self.item_transform = transform
        self.classes: list[str] | None = None  # None: unlabelled, or labels ignored (label -1)
        total = sum(end - start for start, end in self.region_of_interest)
        # One flag per record in shared memory, set by whichever worker fails to decode it (module doc).
        self._bad = torch.zeros(total, dtype=torch.bool).share_memory_()

    @property
    def num_records(self) -> int:
        return int(self._bad.numel())

    @property
    def num_skipped(self) -> int:
        return int(self._bad.sum())

    def __getitem__(self, index: ChunkedIndex | int) -> Any:
        with storage_errors(self.root, self.storage_options):
            record = super().__getitem__(index)
        i = index.index if isinstance(index, ChunkedIndex) else int(index)
        if bool(self._bad[i]):
            return None
        read = getattr(self.item_transform, "read", None)  # the crop reader takes the bytes itself
        try:
            image = read(record["image"]) if read is not None else decode_image(record["image"])
        except Exception as err:  # any decoder failure means "unreadable", as for files
            self._bad[i] = True
            warnings.warn(
                f"skipping unreadable record {i} ({record['path']}): {err}",
                UnreadableImageWarning,
                stacklevel=2,
            )
            return None
        if read is None and self.item_transform is not None:
            image = self.item_transform(image)
        return image, int(record["label"]) if self.classes is not None else -1, i

    def skipped_paths(self) -> list[str]:
        reader = StreamingDataset(
            _source(self.root), storage_options=litdata_options(self.root, self.storage_options)
        )
        return [reader[i]["path"] for i in self._bad.nonzero().flatten().tolist()[:5]]


class ShardLoader(StreamingDataLoader):
    """``StreamingDataLoader`` whose resume refuses a changed split in one line, and whose epochs are the
    trainer's.

    LitData orders an epoch by (seed, the loader's own epoch count), which counts the iterators made. Lightning
    does not restore the loader from an epoch-end checkpoint (it starts the next epoch afresh), so that count
    would restart at the first epoch's order; ``epoch`` (the trainer's epoch, read when an epoch starts)
    keeps every epoch's order that of the uninterrupted run.
    """

    epoch: Callable[[], int] | None = None

    def __iter__(self) -> Any:
        if not self.restore and self.epoch is not None:
            self.current_epoch = self.epoch()  # LitData adds one as it starts the epoch
        return super().__iter__()

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        saved = obj["dataset"]
        current = {
            "world_size": self.dataset.distributed_env.world_size,
            "num_workers": self.num_workers or 1,
            "batch_size": self.batch_size,
            "seed": self.dataset.seed,
            "shuffle": self.dataset.shuffle,
            "drop_last": self.dataset.drop_last,
        }
        changed = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
        if changed:
            raise UserError(
                "the checkpoint's shard loader was saved mid-epoch with "
                + ", ".join(f"{k}={old!r}" for k, (old, _) in changed.items())
                + " but this run has "
                + ", ".join(f"{k}={new!r}" for k, (_, new) in changed.items())
                + ": the rest of that epoch cannot be split without repeating or skipping records; resume with "
                "the same devices, data.num_workers, data.batch_size and seed, or from an epoch-end checkpoint"
            )
        super().load_state_dict(obj)


def shard_train_loader(
    dataset: ShardTrainSet,
    batch_size: int,
    collate_fn: Callable[[list[Any]], Any],
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    rank: int = 0,
    seed: int = 0,
    epoch: Callable[[], int] | None = None,
) -> ShardLoader:
    """The training loader over shards; LitData splits records over ranks and workers (see the module doc).
    ``epoch`` gives the trainer's epoch (see :class:`ShardLoader`)."""
    loader = ShardLoader(
        dataset,
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers and num_workers > 0,
        collate_fn=collate_fn,
        # As in ssl_xcit.data.resumable: workers' random streams from (seed, worker, rank), not the global RNG.
        generator=torch.Generator().manual_seed(seed * 1_000_003 + rank),
        worker_init_fn=partial(pl_worker_init_function, rank=rank) if num_workers > 0 else None,
    )
    loader.epoch = epoch
    return loader


class ShardCrops(ShardImageDataset):
    """``ShardImageDataset`` whose transform may also be the crop reader (``augment_on=device``), which takes
    the record's bytes (the val loss's multi-crop batches)."""

    def __getitem__(self, index: int) -> Any:
        read = getattr(self.transform, "read", None)
        if read is None:
            return super().__getitem__(index)
        if bool(self._bad[index]):
            return None
        record = self.read_record(index)  # its RuntimeError (records and metadata disagree) is not skipped
        try:
            item = read(record["image"])
        except Exception as err:  # any decoder failure means "unreadable", as for files
            self.mark_unreadable(index, err)
            return None
        return item, self.samples[index][1], index


def dataset_view(
    dataset: ImageDataset,
    transform: Callable | None,
    samples: list[tuple[Any, int]] | None = None,
    classes: list[str] | None = None,
) -> ImageDataset:
    """``dataset``'s images (files or records) with ``transform`` (PIL transform or crop reader), relabelled
    when ``samples`` (the same images, new labels) and ``classes`` are given."""
    if not isinstance(dataset, ShardImageDataset):
        return ImageDataset(
            dataset.samples if samples is None else samples, classes or dataset.classes, transform
        )
    view = ShardCrops(
        dataset.root, None, labelled=dataset.labelled, records=dataset.records,
        storage_options=dataset.storage_options,
    )  # fmt: skip
    view.transform = transform  # after construction: ShardImageDataset refuses a reader there
    if samples is not None:
        view.samples, view.classes = [(p, int(y)) for p, y in samples], classes
    return view


def open_shards(
    root: str | Path,
    val_root: str | None,
    val_fraction: float,
    labelled: bool | None,
    verify_images: bool,
    transform: Callable | None,
    storage_options: dict[str, Any] | None = None,
) -> tuple[ShardTrainSet, Dataset | None]:
    """The training set of a prepared dataset (its ``classes`` set) and the val set of ``val_root`` (a prepared
    dataset or anything ``build_dataset`` reads), before relabelling. ``storage_options`` apply to both."""
    from ssl_xcit.data.datasets import build_dataset
    from ssl_xcit.data.resumable import run_seed

    if val_fraction > 0:
        # LitData streams every record of every chunk; leaving some out would give the ranks unequal numbers of
        # batches (or batches short of the held-out records). Prepare the val images as a dataset instead.
        raise UserError(
            f"val_fraction={val_fraction} is not available with a prepared dataset ({root}): give data.val_root "
            "(an image folder or a dataset prepared from the val images) instead"
        )
    if verify_images:
        raise UserError(
            f"verify_images decodes image files; {root} is a prepared dataset, whose unreadable records are "
            "skipped and counted while training: leave data.verify_images off"
        )
    classes = shard_classes(root, storage_options) if labelled is not False else None
    if labelled and classes is None:
        raise UserError(f"labels were requested but the prepared dataset {root} has none")
    train = ShardTrainSet(root, transform, seed=run_seed(), storage_options=storage_options)
    train.classes = classes
    if val_root is not None and is_url(val_root):
        return train, ShardImageDataset(val_root, storage_options=storage_options)
    return train, build_dataset(val_root) if val_root is not None else None


def knn_bank(train: ShardTrainSet, transform: Callable, limit: int | None, seed: int) -> ShardCrops:
    """The k-NN bank: the training records with the eval transform, at most ``limit`` of them (the same
    deterministic stratified subsample as for folders; the labels come from the metadata, no record is read)."""
    bank = ShardCrops(train.root, transform, labelled=True, storage_options=train.storage_options)
    if limit is not None and limit < len(bank):
        _, kept = stratified_split(bank.samples, limit / len(bank), seed)
        position = {path: i for i, (path, _) in enumerate(bank.samples)}
        bank = ShardCrops(
            train.root, transform, labelled=True, records=[position[p] for p, _ in kept],
            storage_options=train.storage_options,
        )  # fmt: skip
    return bank
