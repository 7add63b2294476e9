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

import json
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from PIL import UnidentifiedImageError

from ssl_xcit.data.record_image import decode_image, resize_short_side
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


def fetch_file(
    root: str | Path, name: str, dest: str | Path, storage_options: dict[str, Any] | None = None
) -> Path | None:
    """The file ``name`` of a prepared dataset as a local path (downloaded into ``dest`` for a URL); None when
    it does not exist. Object storage goes through LitData's own providers (s3, gs), the clients it reads the
    chunks with, so the marker needs no other credentials than the chunks (``ssl_xcit.data.storage``)."""
    if not is_url(root):
        path = Path(root).expanduser() / name
        return path if path.is_file() else None
    from ssl_xcit.data.storage import provider, storage_errors

    remote = f"{str(root).rstrip('/')}/{name}"
    fs = provider(str(root), storage_options)
    with storage_errors(str(root), storage_options):
        if not fs.exists(remote):
            return None
        local = Path(dest) / name
        fs.download_file(remote, str(local))
    return local


def read_meta(root: str | Path, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``ssl_xcit_shards.json`` of a prepared dataset; a clear error when it is missing or not ours."""
    with tempfile.TemporaryDirectory(prefix="ssl_xcit_meta_") as scratch:
        path = fetch_file(root, META_FILE, scratch, storage_options)
        if path is None:
            from ssl_xcit.data.storage import missing_dataset

            missing = missing_dataset(str(root), META_FILE, storage_options)
            if missing is not None:
                raise missing
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


class _RecordWriter:
    """``litdata.optimize``'s function: listing index -> the record of that file, or nothing for an unreadable
    one (named in a per-process file of ``scratch``, which the main process gathers for the summary).

    A class rather than a closure so that it pickles into LitData's spawned workers."""

    def __init__(self, files: list[tuple[str, int, str]], resize_short: int | None, scratch: str) -> None:
        self.files = files  # (absolute path, label, path relative to the source root)
        self.resize_short = resize_short
        self.scratch = scratch

    def __call__(self, index: int) -> dict[str, Any] | None:
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
            return None  # LitData stores nothing for it (its checkpoints then count stored records, see
            # ssl_xcit.data.prepare_state)
        # ``Text``: LitData stores a plain string that names an existing file (a relative path, seen from the
        # worker's folder) as that file's content; Text is stored, and read back, as the string itself.
        return {"image": data, "label": label, "path": Text(text=rel)}


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


def _check_out(out: str, overwrite: bool, resume: bool, storage_options: dict[str, Any] | None) -> str:
    """What ``out`` holds: ``"finished"``, ``"partial"`` (an interrupted prepare) or ``"empty"``. Refuses an
    ``out`` holding anything else, and a prepared dataset, finished or not, unless ``overwrite`` (or, for an
    interrupted one, ``resume``) was given."""
    from ssl_xcit.data import prepare_state

    with tempfile.TemporaryDirectory(prefix="ssl_xcit_check_") as scratch:
        finished = fetch_file(out, META_FILE, scratch, storage_options) is not None
        if is_url(out):
            # LitData writes index.json at the end; its checkpoints mark an interrupted run before that.
            partial = not finished and any(
                _remote_exists(out, name, storage_options)
                for name in ("index.json", ".checkpoints/config.json")
            )
        else:
            partial = not finished and (
                prepare_state.partial_dir(out).is_dir() or (Path(out) / "index.json").is_file()
            )
    if finished and not (overwrite or resume):
        raise UserError(
            f"{out} is already a prepared dataset; pass --overwrite to replace it, or choose another OUT"
        )
    if partial and not (overwrite or resume):
        raise UserError(
            f"{out} holds an interrupted `ssl-xcit prepare` (chunks, no {META_FILE}); pass --resume to continue "
            "it or --overwrite to start again"
        )
    local = Path(out).expanduser()
    if not is_url(out) and local.exists() and not (finished or partial):
        if not local.is_dir():
            raise UserError(f"OUT {out} is a file; give a folder to create")
        if any(local.iterdir()):
            raise UserError(
                f"OUT {out} is a folder holding other files, not a prepared dataset; choose another"
            )
    return "finished" if finished else "partial" if partial else "empty"


def prepare_shards(
    src: str | Path,
    out: str,
    *,
    workers: int = 1,
    resize_short: int | None = None,
    chunk_bytes: str = "64MB",
    overwrite: bool = False,
    resume: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: bool = True,
    print_summary: bool = True,
) -> dict[str, Any]:
    """Write the images of ``src`` (an ImageFolder tree, a folder or a list file) as LitData shards in ``out``.

    Records keep the listing order of :func:`~ssl_xcit.data.folders.folder_dataset` (LitData's workers each
    take a contiguous slice in order), so record ``i`` of ``out`` is the ``i``-th readable image of ``src``.
    A local ``out`` is written into ``.<name>.partial`` beside it and renamed into place once finished; a URL
    ``out`` is written in place by LitData, and ``ssl_xcit_shards.json`` uploaded last marks it finished.
    ``resume`` continues an interrupted run with the same settings where its workers' last stored chunks end
    (:mod:`ssl_xcit.data.prepare_state`); for a finished ``out`` it returns the stored summary, and with
    nothing to continue it starts afresh. ``storage_options``: see :mod:`ssl_xcit.data.storage`.
    Returns the summary also stored in ``ssl_xcit_shards.json``.
    """
    import litdata

    from ssl_xcit.data import prepare_state
    from ssl_xcit.data.storage import litdata_options, storage_errors
    from ssl_xcit.utils.io import current_umask

    if resize_short is not None and resize_short < 1:
        raise UserError(f"--resize-short {resize_short}: give a positive number of pixels")
    if workers < 1:
        raise UserError(f"--workers {workers}: give at least 1")
    if resume and overwrite:
        raise UserError("--resume continues an interrupted prepare and --overwrite starts again: give one")
    src = Path(src).expanduser()
    url = is_url(out)
    out = str(out) if url else str(Path(out).expanduser())
    found = _check_out(out, overwrite, resume, storage_options)
    if found == "finished" and resume:
        print(f"{out} is already prepared; nothing to resume")
        return read_meta(out, storage_options)
    files, classes = _listing(src)
    resume = resume and found == "partial"
    state = prepare_state.state_dir(out, url)
    settings = {
        "source": str(src.resolve()),
        "listing": prepare_state.listing_digest(files),
        "resize_short": resize_short,
        "chunk_bytes": chunk_bytes,
        "workers": min(workers, len(files)),
    }
    if url:
        target = out
        if overwrite:  # an interrupted overwrite must not leave the old marker in front of new chunks
            with storage_errors(out, storage_options):
                _remote_delete(out, META_FILE, storage_options)
    else:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        target = str(prepare_state.partial_dir(out))
        if not resume:
            shutil.rmtree(target, ignore_errors=True)
            os.makedirs(target)
            os.chmod(target, 0o777 & ~current_umask())
    prepare_state.start(state, settings, resume, out)
    if resume:
        with storage_errors(out, storage_options):
            prepare_state.fix_checkpoints(target, prepare_state.skipped_indices(state), storage_options)
    try:
        with prepare_state.litdata_cache(state), storage_errors(out, storage_options):
            litdata.optimize(
                _RecordWriter(files, resize_short, str(state)),
                list(range(len(files))),
                output_dir=target,
                chunk_bytes=chunk_bytes,
                num_workers=settings["workers"],
                reorder_files=False,  # keep the listing order: k-NN and embed map record i to file i
                keep_data_ordered=True,
                use_checkpoint=True,  # what --resume continues from
                # LitData refuses a non-empty URL without a mode; "append" adds to nothing (no index.json yet)
                mode="overwrite" if url and overwrite else "append" if url and resume else None,
                storage_options=litdata_options(out, storage_options),
                verbose=progress,
                # Spawned workers re-import torch and litdata (about 10 s each on a small machine) and fork ones
                # share them; prepare has started no CUDA context and no threads of its own to copy.
                start_method="fork" if sys.platform == "linux" else None,
            )
            meta = _summary(
                src, files, classes, str(state), target, resize_short, chunk_bytes, storage_options
            )
            _write_meta(meta, target, str(state), storage_options)
        shutil.rmtree(state, ignore_errors=True)
        if not url:
            _move_into_place(Path(target), Path(out))
    except Exception:
        # A failure (not an interruption, which --resume continues) leaves nothing behind.
        if not url:
            shutil.rmtree(target, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)
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
    storage_options: dict[str, Any] | None = None,
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
    index_path = fetch_file(target, "index.json", scratch, storage_options)
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


def _write_meta(
    meta: dict[str, Any], target: str, scratch: str, storage_options: dict[str, Any] | None = None
) -> None:
    from ssl_xcit.data.storage import provider
    from ssl_xcit.utils.io import atomic_write_json

    if not is_url(target):
        atomic_write_json(meta, Path(target) / META_FILE)
        return
    local = atomic_write_json(meta, Path(scratch) / META_FILE)
    remote = f"{target.rstrip('/')}/{META_FILE}"
    provider(remote, storage_options).upload_file(str(local), remote)


def _remote_exists(root: str, name: str, storage_options: dict[str, Any] | None = None) -> bool:
    from ssl_xcit.data.storage import provider, storage_errors

    remote = f"{root.rstrip('/')}/{name}"
    with storage_errors(root, storage_options):
        return provider(remote, storage_options).exists(remote)


def _remote_delete(root: str, name: str, storage_options: dict[str, Any] | None = None) -> None:
    from ssl_xcit.data.storage import provider

    remote = f"{root.rstrip('/')}/{name}"
    fs = provider(remote, storage_options)
    if fs.exists(remote):
        fs.delete_file_or_directory(remote)


def _move_into_place(finished: Path, out: Path) -> None:
    """Rename the finished folder to ``out``; an old ``out`` (``--overwrite``) goes only after that."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(finished, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
