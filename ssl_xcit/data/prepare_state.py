"""Where an unfinished ``ssl-xcit prepare`` keeps its state, so that ``--resume`` continues it.

LitData's ``optimize(use_checkpoint=True)`` records, after every chunk a worker writes, how many of that
worker's inputs are stored; a rerun skips them. What LitData does not keep is ours:

- the files left out as unreadable (the summary names them, and record ``i`` maps to the ``i``-th *kept*
  file), one JSON line per file, written by the worker that met it;
- the settings and listing of the run, compared on resume so that a changed source or setting never mixes
  two preparations in one output.

A local OUT is written in ``.<name>.partial`` beside it, which holds this state in ``.ssl_xcit_prepare/``; a URL
OUT is written in place, its state in ``$SSL_XCIT_CACHE/prepare/<hash of the URL>`` on the machine that runs
``prepare`` (resume a URL on that machine). There LitData's own local chunk cache lives too: its default, one
``/tmp/chunks`` for every run on the machine, would mix two runs' leftover chunks.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ssl_xcit.errors import UserError

SETTINGS_FILE = "settings.json"


def partial_dir(out: str) -> Path:
    """The folder a local ``out`` is written in until it is finished."""
    out_path = Path(out)
    return out_path.parent / f".{out_path.name}.partial"


def state_dir(out: str, is_url: bool) -> Path:
    """The folder of ``out``'s resume state (module doc)."""
    if not is_url:
        return partial_dir(out) / ".ssl_xcit_prepare"
    root = os.environ.get("SSL_XCIT_CACHE") or Path.home() / ".cache" / "ssl_xcit"
    return Path(root) / "prepare" / hashlib.sha256(out.rstrip("/").encode()).hexdigest()[:16]


def start(state: Path, settings: dict[str, Any], resume: bool, out: str) -> None:
    """Create ``state`` for a new run, or check on ``resume`` that the interrupted run had the same settings
    and listing (``settings``), naming what changed."""
    saved_path = state / SETTINGS_FILE
    if resume and saved_path.is_file():
        saved = json.loads(saved_path.read_text())
        changed = sorted(k for k in settings if saved.get(k) != settings[k])
        if changed:
            raise UserError(
                f"{out}: the interrupted prepare had other {', '.join(changed)} than this one "
                f"({', '.join(f'{k}={saved.get(k)!r}' for k in changed if k != 'listing')}); resume it with "
                "the same SRC and settings, or pass --overwrite to start again"
            )
        return
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    saved_path.write_text(json.dumps(settings))


def listing_digest(files: list[tuple[str, int, str]]) -> str:
    """A digest of the listing (relative paths, labels, sizes): a file added, removed or rewritten changes it."""
    entries = [(rel, label, os.stat(path).st_size) for path, label, rel in files]
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


@contextmanager
def litdata_cache(state: Path) -> Iterator[None]:
    """LitData's local chunk and data caches of ``optimize`` inside ``state`` (module doc); its forked workers
    inherit the environment."""
    names = ("DATA_OPTIMIZER_CACHE_FOLDER", "DATA_OPTIMIZER_DATA_CACHE_FOLDER")
    old = {name: os.environ.get(name) for name in names}
    os.environ[names[0]], os.environ[names[1]] = str(state / "chunks"), str(state / "data")
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def skipped_indices(state: Path) -> set[int]:
    """The listing indices of the files the workers left out as unreadable so far (their logs in ``state``)."""
    return {
        json.loads(line)["index"]
        for log in state.glob("skipped-*.jsonl")
        for line in log.read_text().splitlines()
        if line.strip()
    }


def inputs_done(items: list[int], stored: int, skipped: set[int]) -> int:
    """How many of a worker's ``items`` (listing indices, in order) it had done when it had stored ``stored``
    records, ``skipped`` being the indices that store none."""
    count = 0
    for position, item in enumerate(items):
        if count == stored:
            return position
        count += item not in skipped
    if count != stored:
        raise RuntimeError(f"a LitData checkpoint counts {stored} records, the worker's inputs give {count}")
    return len(items)


def fix_checkpoints(target: str, skipped: set[int], storage_options: dict[str, Any] | None = None) -> int:
    """Make LitData's checkpoints of ``target`` count the inputs each worker has done; returns how many changed.

    LitData 0.2.76 saves the number of records a worker has *stored* as the number of inputs it has *done*, and
    a resume slices the worker's inputs there. An input that stores nothing (an unreadable file) makes the two
    differ, and the resumed worker would store the inputs after it a second time. The records in a
    checkpoint's chunks are what is stored; the skipped files say which inputs gave none.
    """
    from ssl_xcit.data.storage import provider

    base = f"{target.rstrip('/')}/.checkpoints"
    remote = target.startswith(("s3://", "gs://"))
    fs = provider(target, storage_options) if remote else None

    def read(name: str) -> dict[str, Any] | None:
        if not remote:
            path = Path(base) / name
            return json.loads(path.read_text()) if path.is_file() else None
        if not fs.exists(f"{base}/{name}"):
            return None
        with tempfile.TemporaryDirectory() as scratch:
            fs.download_file(f"{base}/{name}", f"{scratch}/{name}")
            return json.loads(Path(scratch, name).read_text())

    def write(name: str, value: dict[str, Any]) -> None:
        if not remote:
            (Path(base) / name).write_text(json.dumps(value))
            return
        with tempfile.TemporaryDirectory() as scratch:
            Path(scratch, name).write_text(json.dumps(value))
            fs.upload_file(f"{scratch}/{name}", f"{base}/{name}")

    config = read("config.json")
    if config is None:
        return 0
    changed = 0
    for worker, items in enumerate(config["workers_user_items"]):
        checkpoint = read(f"checkpoint-{worker}.json")
        if checkpoint is None:
            continue
        stored = sum(chunk["chunk_size"] for chunk in checkpoint["chunks"])
        done = inputs_done(items, stored, skipped)
        if checkpoint.get("inputs_done") != done:
            checkpoint["inputs_done"] = checkpoint["done_till_index"] = done
            write(f"checkpoint-{worker}.json", checkpoint)
            changed += 1
    return changed
