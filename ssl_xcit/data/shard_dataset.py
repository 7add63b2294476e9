"""``ShardImageDataset``: a prepared dataset (``ssl-xcit prepare``) read by index, as ``ImageDataset`` reads files.

The evaluation commands (``knn``, ``linear``, ``embed``) index their datasets and keep the dataset order, so
they read shards through LitData's random access (``StreamingDataset[i]``) rather than its streaming order.
The sample list (record paths and labels, in record order) comes from ``ssl_xcit_shards.json``, so building the
dataset reads no record; each record read is checked against it.

A local dataset is read in place. A remote one (``s3://``, ``gs://``) is read through LitData's chunk cache
(its default cache folder), which downloads whole chunks on first access; ``storage_options`` name its endpoint
and the like (``ssl_xcit.data.storage``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ssl_xcit.data.image_dataset import ImageDataset
from ssl_xcit.data.shards import decode_image, is_url, read_meta
from ssl_xcit.errors import UserError


class ShardImageDataset(ImageDataset):
    """Records of a prepared dataset -> ``(transform(image), label, index)``, ``None`` for an undecodable one.

    ``samples`` holds each record's path relative to the source root it was prepared from (not a file on this
    machine) and its label. ``labelled``: ``None`` keeps the stored labels, ``False`` ignores them (label -1),
    ``True`` requires them. ``records`` selects record indices (a subset, in that order); default all.
    """

    decoder = staticmethod(decode_image)  # keys the feature cache on this decoder's source

    def __init__(
        self,
        root: str | Path,
        transform: Callable | None = None,
        labelled: bool | None = None,
        records: Sequence[int] | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if getattr(transform, "read", None) is not None:
            raise TypeError(
                f"{type(transform).__name__} reads image files itself; ShardImageDataset decodes records and "
                "needs a transform of PIL images"
            )
        self.root = str(root) if is_url(root) else str(Path(root).expanduser())
        self.storage_options = dict(storage_options or {})
        meta = read_meta(self.root, self.storage_options)
        stored = meta.pop("samples")  # kept once, as ``samples``: every DataLoader worker gets a copy
        self.meta, self.num_records = meta, len(stored)
        classes = meta["classes"]
        if labelled and classes is None:
            raise UserError(f"labels were requested but the prepared dataset {root} is unlabelled")
        if labelled is False:
            classes = None
        self.records = list(range(len(stored))) if records is None else [int(r) for r in records]
        samples = [(stored[r][0], stored[r][1] if classes is not None else -1) for r in self.records]
        super().__init__(samples, classes, transform)
        self._stream: Any = None
        self._stream_pid: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        # LitData's dataset holds threads and open files: each DataLoader worker opens its own.
        return dict(self.__dict__, _stream=None, _stream_pid=None)

    def _dataset(self) -> Any:
        if self._stream is None or self._stream_pid != os.getpid():
            from litdata import StreamingDataset

            from ssl_xcit.data.storage import litdata_options, storage_errors

            with storage_errors(self.root, self.storage_options):
                stream = StreamingDataset(
                    self.root, storage_options=litdata_options(self.root, self.storage_options)
                )
            if len(stream) != self.num_records:
                raise UserError(
                    f"{self.root}: index.json lists {len(stream)} records, ssl_xcit_shards.json "
                    f"{self.num_records}; the folder mixes two preparations, prepare it again"
                )
            self._stream, self._stream_pid = stream, os.getpid()
        return self._stream

    def read_record(self, index: int) -> dict[str, Any]:
        """The raw record of sample ``index`` (``image`` bytes, ``label``, ``path``)."""
        from ssl_xcit.data.storage import storage_errors

        with storage_errors(self.root, self.storage_options):
            record = self._dataset()[self.records[index]]
        if record["path"] != self.samples[index][0].as_posix():
            raise RuntimeError(
                f"{self.root}: record {self.records[index]} is {record['path']}, ssl_xcit_shards.json says "
                f"{self.samples[index][0]}"
            )
        return record

    def _decode(self, index: int) -> Any:
        try:
            return decode_image(self.read_record(index)["image"])
        except RuntimeError:
            raise
        except Exception as err:  # PIL raises OSError, ValueError, SyntaxError, DecompressionBombError...
            self.mark_unreadable(index, err)
            return None

    def __getitem__(self, index: int) -> tuple[Any, int, int] | None:
        if bool(self._bad[index]):
            return None
        image = self._decode(index)
        if image is None:
            return None
        if self.transform is not None:
            image = self.transform(image)
        return image, self.samples[index][1], index

    def verify(self, num_threads: int = 4) -> int:
        """Decode every record once, flagging the undecodable ones; returns their number. (One thread: LitData's
        reader is not shared between threads.)"""
        for index in range(len(self)):
            if not bool(self._bad[index]):
                self._decode(index)
        return self.num_skipped

    def subset(self, indices: Sequence[int], transform: Callable | None | str = "same") -> ShardImageDataset:
        return ShardImageDataset(
            self.root,
            self.transform if transform == "same" else transform,
            labelled=self.labelled,
            records=[self.records[i] for i in indices],
            storage_options=self.storage_options,
        )

    def files_fingerprint(self) -> str:
        """What the feature cache keys the data on: the preparation's id (new on every ``prepare``), the
        root, and the records and labels taken."""
        from ssl_xcit.utils.io import sha256_json

        return sha256_json([self.meta["id"], self.root, self.records, self.targets])

    def __repr__(self) -> str:
        kind = f"{len(self.classes)} classes" if self.classes is not None else "unlabelled"
        return f"ShardImageDataset({len(self)} images, {kind}, {self.root})"
