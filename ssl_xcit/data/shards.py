"""LitData shards: the on-disk (or object-storage) format that ``ssl-xcit prepare`` writes and every command reads.

A prepared dataset is a folder (local, or an ``s3://`` or ``gs://`` URL) holding LitData's chunk files
and ``index.json``, plus our own ``ssl_xcit_shards.json`` written last: the class list, counts and the settings
of ``prepare``. Its presence is what marks the dataset finished, so a folder with chunks but no
``ssl_xcit_shards.json`` is an interrupted ``prepare`` and is refused, never read as a smaller dataset.

Each record is a dict:

- ``image``: the file's original encoded bytes (JPEG, PNG, ...), not re-encoded unless ``prepare --resize-short``
  asked for it, so that decoding can happen in a worker (PIL) or on the GPU (``decode_on: device``);
- ``label``: the class index, -1 when unlabelled;
- ``path``: the image's path relative to the source root (for messages and for ``embed``'s keys).

Plain ``bytes`` rather than LitData's JPEG serializer: that one decodes in the worker, which would rule out GPU
decoding.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError

from ssl_xcit.errors import UserError

META_FILE = "ssl_xcit_shards.json"
FORMAT_VERSION = 1
URL_SCHEMES = ("s3://", "gs://", "azure://")


def is_url(root: str | Path) -> bool:
    return str(root).startswith(URL_SCHEMES)


def is_shard_root(root: str | Path) -> bool:
    """True for a prepared dataset: an object-storage URL, or a local folder with LitData's ``index.json``.

    A local folder with ``index.json`` but without ``ssl_xcit_shards.json`` still counts (so that reading it
    raises the "interrupted prepare" error of :func:`read_meta` instead of scanning chunk files as images).
    """
    if is_url(root):
        return True
    root = Path(root).expanduser()
    return root.is_dir() and ((root / "index.json").is_file() or (root / META_FILE).is_file())


def fetch_file(root: str | Path, name: str, dest: str | Path) -> Path | None:
    """The file ``name`` of a prepared dataset as a local path (downloaded into ``dest`` for a URL); None when
    it does not exist. Object storage goes through LitData's own providers (s3, gs), the clients it reads the
    chunks with, so the marker needs no other credentials than the chunks. (LitData has no azure provider.)"""
    if not is_url(root):
        path = Path(root).expanduser() / name
        return path if path.is_file() else None
    from litdata.streaming.fs_provider import _get_fs_provider

    remote = f"{str(root).rstrip('/')}/{name}"
    try:
        provider = _get_fs_provider(remote)
    except ValueError:
        raise UserError(
            f"{root}: this version of ssl-xcit reads prepared datasets from s3:// and gs:// URLs or local "
            "folders; copy the dataset to one of those"
        ) from None
    if not provider.exists(remote):
        return None
    local = Path(dest) / name
    provider.download_file(remote, str(local))
    return local


def read_meta(root: str | Path) -> dict[str, Any]:
    """The ``ssl_xcit_shards.json`` of a prepared dataset; a clear error when it is missing or not ours."""
    with tempfile.TemporaryDirectory(prefix="ssl_xcit_meta_") as scratch:
        path = fetch_file(root, META_FILE, scratch)
        if path is None:
            raise UserError(
                f"{root} has no {META_FILE}: an interrupted or foreign `ssl-xcit prepare` output; run "
                "`ssl-xcit prepare SRC OUT --overwrite` to write it again before reading it"
            )
        meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise UserError(
            f"{root}/{META_FILE}: format {meta.get('format')!r}, this version of ssl-xcit reads {FORMAT_VERSION}"
        )
    return meta


def decode_image(data: bytes, exif_transpose: bool = True) -> Image.Image:
    """Decode a record's encoded bytes into an RGB PIL image (EXIF orientation applied, as for files)."""
    with Image.open(io.BytesIO(data)) as image:
        image.load()  # the full decode, so truncated bytes raise here
        if exif_transpose:
            image = ImageOps.exif_transpose(image)
        return image.convert("RGB")


def resize_short_side(data: bytes, short: int) -> bytes:
    """``data`` re-encoded with its shorter side ``short`` px, or unchanged when that side is not longer.

    The EXIF orientation is applied first (the re-encoded file carries none). JPEG stays JPEG (quality 95),
    every other format becomes PNG (lossless), so that nothing but the resize loses detail.
    """
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        fmt = image.format
        icc = image.info.get("icc_profile")
        image = ImageOps.exif_transpose(image)
        width, height = image.size
        if min(width, height) <= short:
            return data
        scale = short / min(width, height)
        size = (short, round(height * scale)) if width <= height else (round(width * scale), short)
        if image.mode not in ("RGB", "RGBA", "L", "LA"):
            image = image.convert("RGBA" if "transparency" in image.info or "A" in image.mode else "RGB")
        image = image.resize(size, Image.Resampling.LANCZOS)
        out = io.BytesIO()
        if fmt == "JPEG":
            image.convert("RGB" if image.mode != "L" else "L").save(out, "JPEG", quality=95, icc_profile=icc)
        else:
            image.save(out, "PNG", icc_profile=icc)
        return out.getvalue()


class _RecordWriter:
    """``litdata.optimize``'s function: listing index -> the record of that file, or nothing for an unreadable
    one (named in a per-process file of ``scratch``, which the main process gathers for the summary).

    A class rather than a closure so that it pickles into LitData's spawned workers."""

    def __init__(self, files: list[tuple[str, int, str]], resize_short: int | None, scratch: str) -> None:
        self.files = files  # (absolute path, label, path relative to the source root)
        self.resize_short = resize_short
        self.scratch = scratch

    def __call__(self, index: int):
        from litdata import Text

        path, label, rel = self.files[index]
        try:
            with open(path, "rb") as handle:
                data = handle.read()
            decode_image(data)  # a file the readers could not decode is left out, not stored
            if self.resize_short is not None:
                data = resize_short_side(data, self.resize_short)
        except Exception as err:  # PIL raises OSError, ValueError, SyntaxError, DecompressionBombError...
            reason = (
                "not an image format Pillow can decode" if isinstance(err, UnidentifiedImageError) else err
            )
            with open(Path(self.scratch) / f"skipped-{os.getpid()}.jsonl", "a") as log:
                log.write(json.dumps({"index": index, "path": rel, "error": str(reason)}) + "\n")
            return
        # ``Text``: LitData stores a plain string that names an existing file (a relative path, seen from the
        # worker's folder) as that file's content; Text is stored, and read back, as the string itself.
        yield {"image": data, "label": label, "path": Text(text=rel)}


def _listing(src: Path) -> tuple[list[tuple[str, int, str]], list[str] | None]:
    """(absolute path, label, relative path) of every image of ``src`` in the readers' order, and the classes."""
    from ssl_xcit.data.folders import folder_dataset

    if is_shard_root(src):
        raise UserError(
            f"{src} is already a prepared dataset; give the image folder or list file it came from"
        )
    dataset = folder_dataset(src)
    base = src if src.is_dir() else src.parent
    files = [(str(p), y, Path(os.path.relpath(p, base)).as_posix()) for p, y in dataset.samples]
    return files, dataset.classes


def _check_out(out: str, overwrite: bool) -> None:
    """Refuse an ``out`` that holds something, unless it is a prepared dataset (finished or not) and
    ``overwrite`` was given."""
    with tempfile.TemporaryDirectory(prefix="ssl_xcit_check_") as scratch:
        finished = fetch_file(out, META_FILE, scratch) is not None
        partial = not finished and fetch_file(out, "index.json", scratch) is not None
    if finished and not overwrite:
        raise UserError(
            f"{out} is already a prepared dataset; pass --overwrite to replace it, or choose another OUT"
        )
    if partial and not overwrite:
        raise UserError(
            f"{out} holds an interrupted `ssl-xcit prepare` (chunks, no {META_FILE}); pass --overwrite to "
            "prepare it again"
        )
    local = Path(out).expanduser()
    if not is_url(out) and local.exists() and not (finished or partial):
        if not local.is_dir():
            raise UserError(f"OUT {out} is a file; give a folder to create")
        if any(local.iterdir()):
            raise UserError(
                f"OUT {out} is a folder holding other files, not a prepared dataset; choose another"
            )


def prepare_shards(
    src: str | Path,
    out: str,
    *,
    workers: int = 1,
    resize_short: int | None = None,
    chunk_bytes: str = "64MB",
    overwrite: bool = False,
    progress: bool = True,
    print_summary: bool = True,
) -> dict[str, Any]:
    """Write the images of ``src`` (an ImageFolder tree, a folder or a list file) as LitData shards in ``out``.

    Records keep the listing order of :func:`~ssl_xcit.data.folders.folder_dataset` (LitData's workers each
    take a contiguous slice in order), so record ``i`` of ``out`` is the ``i``-th readable image of ``src``.
    A local ``out`` is written into a temporary sibling folder and renamed into place once finished; a URL
    ``out`` is written in place by LitData, and ``ssl_xcit_shards.json`` uploaded last marks it finished.
    Returns the summary also stored in ``ssl_xcit_shards.json``.
    """
    import litdata

    from ssl_xcit.utils.io import current_umask

    if resize_short is not None and resize_short < 1:
        raise UserError(f"--resize-short {resize_short}: give a positive number of pixels")
    if workers < 1:
        raise UserError(f"--workers {workers}: give at least 1")
    src = Path(src).expanduser()
    out = str(out) if is_url(out) else str(Path(out).expanduser())
    _check_out(out, overwrite)
    files, classes = _listing(src)

    with tempfile.TemporaryDirectory(prefix="ssl_xcit_prepare_") as scratch:
        if is_url(out):
            target = out
            if overwrite:  # an interrupted overwrite must not leave the old marker in front of new chunks
                _remote_delete(out, META_FILE)
        else:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            target = tempfile.mkdtemp(prefix=f".{Path(out).name}.partial-", dir=Path(out).parent)
            os.chmod(target, 0o777 & ~current_umask())  # mkdtemp's 0700 would outlive the rename
        try:
            litdata.optimize(
                _RecordWriter(files, resize_short, scratch),
                list(range(len(files))),
                output_dir=target,
                chunk_bytes=chunk_bytes,
                num_workers=min(workers, len(files)),
                reorder_files=False,  # keep the listing order: k-NN and embed map record i to file i
                keep_data_ordered=True,
                mode="overwrite" if is_url(out) and overwrite else None,
                verbose=progress,
                # Spawned workers re-import torch and litdata (about 10 s each on a small machine) and fork ones
                # share them; prepare has started no CUDA context and no threads of its own to copy.
                start_method="fork" if sys.platform == "linux" else None,
            )
            meta = _summary(src, files, classes, scratch, target, resize_short, chunk_bytes)
            _write_meta(meta, target, scratch)
            if not is_url(out):
                _move_into_place(Path(target), Path(out))
        except BaseException:
            if not is_url(out):
                shutil.rmtree(target, ignore_errors=True)
            raise
    if print_summary:
        print(format_summary(meta, out))
    return meta


def _summary(
    src: Path,
    files: list[tuple[str, int, str]],
    classes: list[str] | None,
    scratch: str,
    target: str,
    resize_short: int | None,
    chunk_bytes: str,
) -> dict[str, Any]:
    skipped = {}
    for log in sorted(Path(scratch).glob("skipped-*.jsonl")):
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            skipped[entry["index"]] = entry
    kept = [f for i, f in enumerate(files) if i not in skipped]
    if not kept:
        first = skipped[min(skipped)]
        raise UserError(
            f"no readable image in {src}: all {len(files)} files fail to decode, e.g. {first['path']}: "
            f"{first['error']}"
        )
    index_path = fetch_file(target, "index.json", scratch)
    chunks = json.loads(index_path.read_text())["chunks"] if index_path is not None else []
    stored = sum(c["chunk_size"] for c in chunks)
    # LitData logs a failing worker and returns; a short output would break the record -> path mapping
    if stored != len(kept):
        raise RuntimeError(
            f"LitData wrote {stored} records for {len(kept)} readable files (a worker failed?)"
        )
    return {
        "format": FORMAT_VERSION,
        "id": uuid.uuid4().hex,  # a new id per run: feature caches keyed on it never mix two preparations
        "source": str(src),
        "files": len(files),
        "records": len(kept),
        "bytes": sum(c["chunk_bytes"] for c in chunks),
        "shards": len(chunks),
        "chunk_bytes": chunk_bytes,
        "resize_short": resize_short,
        "classes": classes,
        "skipped": [skipped[i]["path"] for i in sorted(skipped)],
        "skipped_errors": [skipped[i]["error"] for i in sorted(skipped)],
        # record order: the readers' samples list without reading a record
        "samples": [[rel, label] for _, label, rel in kept],
    }


def format_summary(meta: dict[str, Any], out: str) -> str:
    """The summary ``prepare`` prints: counts, then every skipped file."""
    kind = f"{len(meta['classes'])} classes" if meta["classes"] is not None else "unlabelled"
    size = f"{meta['bytes'] / 2**20:.1f} MiB"
    line = (
        f"prepared {out}: {meta['records']} of {meta['files']} files ({kind}), {size} in {meta['shards']} "
        f"shards; {len(meta['skipped'])} unreadable files skipped"
    )
    return "\n".join(
        [line, *(f"  skipped {p}: {e}" for p, e in zip(meta["skipped"], meta["skipped_errors"], strict=True))]
    )


def _write_meta(meta: dict[str, Any], target: str, scratch: str) -> None:
    from ssl_xcit.utils.io import atomic_write_json

    if not is_url(target):
        atomic_write_json(meta, Path(target) / META_FILE)
        return
    from litdata.streaming.fs_provider import _get_fs_provider

    local = atomic_write_json(meta, Path(scratch) / META_FILE)
    remote = f"{target.rstrip('/')}/{META_FILE}"
    _get_fs_provider(remote).upload_file(str(local), remote)


def _remote_delete(root: str, name: str) -> None:
    from litdata.streaming.fs_provider import _get_fs_provider

    remote = f"{root.rstrip('/')}/{name}"
    provider = _get_fs_provider(remote)
    if provider.exists(remote):
        provider.delete_file_or_directory(remote)


def _move_into_place(finished: Path, out: Path) -> None:
    """Rename the finished folder to ``out``; an old ``out`` (``--overwrite``) goes only after that."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(finished, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
