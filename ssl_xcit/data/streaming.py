"""Training and monitoring from prepared shards (``ssl-xcit prepare``): LitData's streaming loader.

The training loader is LitData's ``StreamingDataLoader`` over a shuffled ``StreamingDataset``: LitData splits the
epoch's shuffled chunks over global rank x worker (``drop_last``: every rank gets the same number of full
batches; what does not fill ``world_size`` x ``batch_size`` at the end of the epoch's shuffled order is dropped,
at most ``world_size * batch_size - 1`` records an epoch), reads local folders or ``s3://`` / ``gs://`` / ``azure://``
URLs, and its ``state_dict`` / ``load_state_dict`` resume an epoch on the records not yet seen. Lightning saves
that state in the checkpoint (it checkpoints any training loader with both methods), so ``--ckpt_path last``
finishes the interrupted epoch with no record repeated and none lost.

Each record goes through the same per-item transform as a file: DINO's PIL multi-crop (``augment_on=cpu``) or
the crop reader (``augment_on=device``, its ``read`` accepts the record's bytes). A record whose bytes do not
decode yields ``None`` (dropped by the collate) and is flagged in a shared-memory tensor of one flag per record,
as ``ImageDataset`` does for files, so ``num_skipped`` in the training process counts the records any worker
met.

Map-style reading (k-NN bank and queries, the val loss) uses :class:`ShardRecords`, an unshuffled
``StreamingDataset`` indexed by record.
"""

from __future__ import annotations

import tempfile
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

from ssl_xcit.data.datasets import UnreadableImageWarning
from ssl_xcit.data.shards import META_FILE, decode_image, is_url, read_meta
from ssl_xcit.errors import UserError


def shard_classes(root: str | Path) -> list[str] | None:
    """The class names of a prepared dataset (None when unlabelled); a URL's metadata is fetched with
    LitData's own storage client, the one that then streams its chunks."""
    if not is_url(root):
        classes = read_meta(root).get("classes")
        return list(classes) if classes else None
    from litdata.streaming.fs_provider import _get_fs_provider

    url = f"{str(root).rstrip('/')}/{META_FILE}"
    with tempfile.TemporaryDirectory() as folder:
        try:
            _get_fs_provider(url).download_file(url, str(Path(folder) / META_FILE))
        except Exception as err:  # boto3 / gcsfs / azure errors share no base class
            raise UserError(
                f"cannot read {url} ({err}): an unfinished or foreign `ssl-xcit prepare` output, or no access"
            ) from err
        return shard_classes(folder)


def _source(root: str | Path) -> str:
    return str(root) if is_url(root) else str(Path(root).expanduser().resolve())


def transform_record(transform: Callable | None, data: bytes) -> Any:
    """A record's encoded image through a training/eval transform, as ``ImageDataset`` treats a file."""
    read = getattr(transform, "read", None)  # the crop reader reads (and maybe keeps) the bytes itself
    if read is not None:
        return read(data)
    image = decode_image(data)
    return transform(image) if transform is not None else image


class _Flags:
    """One shared-memory flag per record: set by whichever worker fails to decode it (see the module doc)."""

    def _init_flags(self, total: int) -> None:
        self._bad = torch.zeros(total, dtype=torch.bool).share_memory_()

    @property
    def num_skipped(self) -> int:
        return int(self._bad.sum())

    def _item(self, record: dict[str, Any], index: int, transform: Callable | None) -> Any:
        if bool(self._bad[index]):
            return None
        try:
            image = transform_record(transform, record["image"])
        except Exception as err:  # any decoder failure means "unreadable", as for files
            self._bad[index] = True
            warnings.warn(
                f"skipping unreadable record {index} ({record.get('path')}): {err}",
                UnreadableImageWarning,
                stacklevel=2,
            )
            return None
        return image, int(record["label"]), index


class ShardTrainSet(_Flags, StreamingDataset):
    """Shuffled, ``drop_last`` records -> ``(transform(image), label, record index)``, split by LitData."""

    def __init__(self, root: str | Path, transform: Callable | None, seed: int) -> None:
        super().__init__(_source(root), shuffle=True, drop_last=True, seed=seed)
        self.root = str(root)
        self.item_transform = transform
        self._init_flags(sum(end - start for start, end in self.region_of_interest))

    @property
    def num_records(self) -> int:
        return int(self._bad.numel())

    def __getitem__(self, index: ChunkedIndex | int) -> Any:
        record = super().__getitem__(index)
        i = index.index if isinstance(index, ChunkedIndex) else int(index)
        return self._item(record, i, self.item_transform)

    def skipped_paths(self) -> list[str]:
        reader = StreamingDataset(_source(self.root))
        return [reader[i]["path"] for i in self._bad.nonzero().flatten().tolist()[:5]]


# Settings a mid-epoch state must share with the resumed run: any other split would repeat or skip records.
_SAME = ("world_size", "num_workers", "batch_size", "seed", "shuffle", "drop_last")


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
        if obj["num_samples_yielded"] >= len(self.dataset):
            # The saved epoch was complete (an epoch-end checkpoint): LitData would replay its empty rest as
            # a whole epoch of nothing; start the next one instead.
            self.current_epoch = int(obj["current_epoch"])
            return
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


class ShardRecords(_Flags, Dataset):
    """Map-style records in order -> ``(transform(image), label, index)``; ``None`` for an unreadable one.

    ``label_map`` relabels (the k-NN queries take the training class indices). Reading is LitData's random
    access (``StreamingDataset[i]``), opened lazily so a worker opens its own.
    """

    def __init__(
        self,
        root: str | Path,
        transform: Callable | None = None,
        classes: list[str] | None = None,
        indices: list[int] | None = None,
        label_map: dict[int, int] | None = None,
    ) -> None:
        self.root = str(root)
        self.transform = transform
        self.classes = classes
        self.label_map = label_map
        self._reader: StreamingDataset | None = None
        self.indices = list(range(len(self.reader))) if indices is None else list(indices)
        self._init_flags(len(self.indices))

    @property
    def reader(self) -> StreamingDataset:
        if self._reader is None:
            self._reader = StreamingDataset(_source(self.root))
        return self._reader

    @property
    def labelled(self) -> bool:
        return self.classes is not None

    def __len__(self) -> int:
        return len(self.indices)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_reader": None}

    def __getitem__(self, index: int) -> Any:
        record = self.reader[self.indices[index]]
        if self.label_map is not None:
            record = {**record, "label": self.label_map.get(int(record["label"]), -1)}
        return self._item(record, index, self.transform)

    def with_transform(self, transform: Callable | None) -> ShardRecords:
        return ShardRecords(self.root, transform, self.classes, self.indices, self.label_map)

    def relabelled(self, classes: list[str]) -> ShardRecords:
        """The same records, labelled with the indices of ``classes`` (a superset of this set's classes)."""
        index = {name: i for i, name in enumerate(classes)}
        label_map = {y: index[name] for y, name in enumerate(self.classes or [])}
        return ShardRecords(self.root, self.transform, list(classes), self.indices, label_map)

    def skipped_paths(self) -> list[str]:
        bad = self._bad.nonzero().flatten().tolist()[:5]
        return [self.reader[self.indices[i]]["path"] for i in bad]


def open_shards(
    root: str | Path,
    val_root: str | None,
    val_fraction: float,
    labelled: bool | None,
    verify_images: bool,
    transform: Callable | None,
) -> tuple[ShardTrainSet, Dataset | None]:
    """The training set of a prepared dataset (its ``classes`` set) and the val set of ``val_root`` (a prepared
    dataset or anything ``build_dataset`` reads), before relabelling."""
    from ssl_xcit.data.datasets import build_dataset
    from ssl_xcit.data.resumable import run_seed
    from ssl_xcit.data.shards import is_shard_root

    if val_fraction > 0:
        # A held-out split would need every record's label up front (a read of the whole dataset): prepare the
        # val images as a dataset of their own instead.
        raise UserError(
            f"val_fraction={val_fraction} is not available with a prepared dataset ({root}): give data.val_root "
            "(an image folder or a dataset prepared from the val images) instead"
        )
    if verify_images:
        raise UserError(
            f"verify_images decodes image files; {root} is a prepared dataset, whose unreadable records are "
            "skipped and counted while training: leave data.verify_images off"
        )
    classes = shard_classes(root) if labelled is not False else None
    if labelled and classes is None:
        raise UserError(f"labels were requested but the prepared dataset {root} has none")
    train = ShardTrainSet(root, transform, seed=run_seed())
    train.classes = classes
    val: Dataset | None = None
    if val_root is not None:
        val = ShardRecords(val_root, None, shard_classes(val_root)) if is_shard_root(val_root) else None
        val = build_dataset(val_root) if val is None else val
    return train, val


def knn_bank(train: ShardTrainSet, transform: Callable, limit: int | None) -> ShardRecords:
    """The k-NN bank: the training records with the eval transform, at most ``limit`` evenly spaced ones
    (not a stratified subsample, which would read every record's label first)."""
    n = train.num_records
    indices = None
    if limit is not None and limit < n:
        indices = [int(i * n / limit) for i in range(limit)]
    return ShardRecords(train.root, transform, train.classes, indices)
