"""The files ``ssl-xcit embed`` writes, one row per image, and a reader that gives any of them back.

Every format holds the same things: ``embeddings`` (N, D) float32, ``paths`` (N strings), for labelled data
``labels`` (N class indices) and ``classes`` (names), ``skipped`` (the unreadable files, not in the rows) and
``meta`` (how the rows were made: weights, feature, transform, ...).

- ``.npz``: plain arrays (strings as numpy unicode arrays, ``meta`` as one JSON string), so
  ``numpy.load(path, allow_pickle=False)`` reads it.
- ``.pt``: a dict of tensors, lists of strings and the ``meta`` dict; ``torch.load(path, weights_only=True)``.
- ``.csv``: a header ``path,label,e0,...,e{D-1}`` (``label`` is the class name; no column for unlabelled data)
  and one row per image, floats with 9 significant digits (float32 round-trips exactly). A CSV has no place
  for the rest, so ``meta``, ``classes`` and ``skipped`` go to a sidecar ``<OUT>.json``.

Parquet is not offered: it needs pyarrow (a wheel of tens of MB) for what ``.npz`` and ``.csv`` already give
numpy and pandas users; ``pandas.read_csv(OUT).to_parquet(...)`` converts when wanted.

Each file is written to a temporary file and renamed over ``OUT`` (``ssl_xcit.utils.io.atomic_write``), so a
failure mid-write leaves no ``OUT`` (or the previous one untouched).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from ssl_xcit.errors import UserError
from ssl_xcit.utils.io import atomic_write

__all__ = ["FORMATS", "embedding_format", "output_files", "write_embeddings", "read_embeddings"]

FORMATS = (".npz", ".csv", ".pt")


def embedding_format(path: str | os.PathLike) -> str:
    """The format of ``path`` from its extension; a UserError names the valid ones."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise UserError(
            f"cannot tell the embedding format of {path}: its extension must be one of {', '.join(FORMATS)}"
        )
    return suffix


def output_files(path: str | os.PathLike) -> list[Path]:
    """Every file writing ``path`` creates: the file itself, and for ``.csv`` its ``.json`` sidecar."""
    path = Path(path)
    return [path, sidecar(path)] if embedding_format(path) == ".csv" else [path]


def sidecar(path: str | os.PathLike) -> Path:
    """The metadata file of a CSV: ``emb.csv`` -> ``emb.csv.json``."""
    path = Path(path)
    return path.with_name(path.name + ".json")


def _plain_meta(meta: dict[str, Any]) -> dict[str, Any]:
    # A JSON round trip leaves only str/int/float/bool/None/list/dict: readable without pickle everywhere.
    return json.loads(json.dumps(meta, sort_keys=True, default=str))


def write_embeddings(
    path: str | os.PathLike,
    embeddings: torch.Tensor,
    paths: list[str],
    *,
    labels: torch.Tensor | None = None,
    classes: list[str] | None = None,
    skipped: list[str] | None = None,
    meta: dict[str, Any] | None = None,
) -> list[Path]:
    """Write the rows to ``path`` in the format of its extension (atomically); returns the files written."""
    fmt = embedding_format(path)
    embeddings = embeddings.detach().float().cpu().contiguous()
    if embeddings.ndim != 2 or embeddings.shape[0] != len(paths):
        raise ValueError(f"{tuple(embeddings.shape)} embeddings for {len(paths)} paths")
    if (labels is None) != (classes is None):
        raise ValueError("labels and classes go together (both for labelled data, neither otherwise)")
    if labels is not None and labels.shape[0] != len(paths):
        raise ValueError(f"{labels.shape[0]} labels for {len(paths)} paths")
    skipped = [str(p) for p in (skipped or [])]
    meta = _plain_meta(meta or {})
    paths = [str(p) for p in paths]
    labels = None if labels is None else labels.detach().long().cpu()
    if fmt == ".npz":
        with atomic_write(path, "wb") as handle:
            arrays = {
                "embeddings": embeddings.numpy(),
                "paths": np.array(paths, dtype=str),
                "skipped": np.array(skipped, dtype=str),
                "meta": np.array(json.dumps(meta, sort_keys=True)),
            }
            if labels is not None:
                arrays |= {"labels": labels.numpy(), "classes": np.array(classes, dtype=str)}
            np.savez(handle, **arrays)
        return [Path(path)]
    if fmt == ".pt":
        entry: dict[str, Any] = {"embeddings": embeddings, "paths": paths, "skipped": skipped, "meta": meta}
        if labels is not None:
            entry |= {"labels": labels, "classes": list(classes)}  # type: ignore[arg-type]
        with atomic_write(path, "wb") as handle:
            torch.save(entry, handle)
        return [Path(path)]
    side = {"meta": meta, "classes": classes, "skipped": skipped, "rows": len(paths)}
    # Both files are complete on disk before either is renamed into place; the CSV is renamed first.
    with atomic_write(sidecar(path), "w") as meta_handle, atomic_write(path, "w") as handle:
        json.dump(side, meta_handle, indent=2, sort_keys=True)
        meta_handle.write("\n")
        _write_csv(handle, embeddings, paths, labels, classes)
    return [Path(path), sidecar(path)]


def _write_csv(
    handle: IO[str],
    embeddings: torch.Tensor,
    paths: list[str],
    labels: torch.Tensor | None,
    classes: list[str] | None,
) -> None:
    writer = csv.writer(handle, lineterminator="\n")
    label_col = ["label"] if labels is not None else []
    writer.writerow(["path", *label_col, *(f"e{j}" for j in range(embeddings.shape[1]))])
    for i, row in enumerate(embeddings.numpy()):
        label = [classes[int(labels[i])]] if labels is not None and classes is not None else []
        writer.writerow([paths[i], *label, *(f"{x:.9g}" for x in row.tolist())])


def _csv_rows(path: Path) -> Iterator[list[str]]:
    with open(path, newline="") as handle:
        yield from csv.reader(handle)


def read_embeddings(path: str | os.PathLike) -> dict[str, Any]:
    """Any embedding file back as ``{"embeddings" (N, D) float32 tensor, "paths", "skipped", "meta"}`` plus
    ``"labels"`` (tensor) and ``"classes"`` for labelled data; never unpickles."""
    path = Path(path)
    fmt = embedding_format(path)
    if fmt == ".npz":
        with np.load(path, allow_pickle=False) as data:
            out: dict[str, Any] = {
                "embeddings": torch.from_numpy(data["embeddings"].copy()),
                "paths": data["paths"].tolist(),
                "skipped": data["skipped"].tolist(),
                "meta": json.loads(str(data["meta"])),
            }
            if "labels" in data:
                out |= {
                    "labels": torch.from_numpy(data["labels"].copy()),
                    "classes": data["classes"].tolist(),
                }
        return out
    if fmt == ".pt":
        return dict(torch.load(path, map_location="cpu", weights_only=True))
    side = json.loads(sidecar(path).read_text())
    rows = _csv_rows(path)
    header = next(rows)
    first = 2 if len(header) > 1 and header[1] == "label" else 1
    paths, names, values = [], [], []
    for row in rows:
        paths.append(row[0])
        names.append(row[1] if first == 2 else None)
        values.append([float(x) for x in row[first:]])
    if len(paths) != side["rows"]:
        raise UserError(f"{path} has {len(paths)} rows but its {sidecar(path).name} says {side['rows']}")
    out = {
        "embeddings": torch.tensor(values, dtype=torch.float32).reshape(len(paths), len(header) - first),
        "paths": paths,
        "skipped": side["skipped"],
        "meta": side["meta"],
    }
    if first == 2:
        index = {name: i for i, name in enumerate(side["classes"])}
        out |= {
            "labels": torch.tensor([index[n] for n in names], dtype=torch.long),
            "classes": side["classes"],
        }
    return out
