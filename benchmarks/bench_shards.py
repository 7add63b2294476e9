"""Image folders against prepared LitData shards (``ssl-xcit prepare``), side by side, in one run.

Two datasets: (a) the UKBench photos (640 x 480 JPEGs, about 240 KB) repeated by copies to ``--files`` files,
and (b) ``--small`` generated 32 x 32 JPEGs (about 1 KB) in 100 subfolders. Both are built once under ``--work``
(kept between runs); the shards are prepared from them in this run unless ``--reuse`` (the prepare time is
printed). Per dataset and reader:

- first batch (s): from nothing to the first training batch in the training process: the folder walk
  (``build_dataset``) or reading ``index.json`` (``ShardTrainSet``), the loader, its ``--workers`` worker
  start-up and the first batch; the training loaders themselves (``resumable_loader`` for folders,
  ``shard_train_loader`` for shards);
- images/s per worker: the next ``--batches`` batches with ``--workers`` (1) worker, each image decoded (PIL)
  and resized to 64 x 64 (a minimal transform: the reading, not the augmentation, is what differs);

both the median of ``--repeats`` passes, folder and shards taking turns;
- images/s ratio per pass: shards over folder in each pair of adjacent passes, lowest and highest. The
  machine the benchmark was written on is shared, and this range says how much one pass pair can mislead;
- bytes per image: from file sizes, not I/O counters (the page cache is warm and shared with other jobs): a
  folder reads each file whole; shards read whole chunks, so it is the chunk files' total (records, their
  offset tables and headers) over the records, and files opened per epoch is chunks against files.

The page cache is warm for both readers (every file was read at least once while building or preparing): the
first-batch column measures listing and start-up, not a cold disk.

    python benchmarks/bench_shards.py --work /tmp/bench_shards
    python benchmarks/bench_shards.py --tiny --work /tmp/bench_shards_tiny
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ssl_xcit.data.datasets import build_dataset, collate_train
from ssl_xcit.data.resumable import resumable_loader
from ssl_xcit.data.shards import META_FILE, prepare_shards
from ssl_xcit.data.streaming import ShardTrainSet, shard_train_loader

ROOT = Path(__file__).resolve().parents[1]
UKBENCH = ROOT.parent / "shared" / "data" / "retrieval_mini" / "ukbench"


class Minimal:
    """Decode (done by the reader) and a 64 x 64 resize to a uint8 tensor."""

    def __call__(self, image: Image.Image) -> list[torch.Tensor]:
        return [torch.from_numpy(np.array(image.resize((64, 64)))).permute(2, 0, 1)]


def ukbench_folder(work: Path, files: int, source: Path) -> Path:
    """``files`` copies cycling over the UKBench photos of ``source``: copies, not links, so that the folder
    holds as many distinct bytes as the shards made from it (links would read the same few files' cached
    pages over and over)."""
    folder = work / f"ukbench_{files}"
    if not (folder / ".done").exists():
        folder.mkdir(parents=True, exist_ok=True)
        photos = sorted(source.glob("*.jpg"))
        for i in range(files):
            shutil.copyfile(photos[i % len(photos)], folder / f"{i:06d}.jpg")
        (folder / ".done").touch()
    return folder


def small_folder(work: Path, files: int) -> Path:
    """``files`` distinct 32 x 32 JPEGs in 100 subfolders (random blocks, encoded once each)."""
    folder = work / f"small_{files}"
    if not (folder / ".done").exists():
        rng = np.random.default_rng(0)
        for i in range(files):
            sub = folder / f"{i % 100:02d}"
            sub.mkdir(parents=True, exist_ok=True)
            blocks = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8).repeat(8, 0).repeat(8, 1)
            buffer = io.BytesIO()
            Image.fromarray(blocks).save(buffer, format="JPEG", quality=90)
            (sub / f"{i:06d}.jpg").write_bytes(buffer.getvalue())
        (folder / ".done").touch()
    return folder


def shards_of(folder: Path, workers: int, reuse: bool) -> tuple[Path, float | None]:
    out = folder.parent / f"{folder.name}_shards"
    if reuse and (out / META_FILE).exists():
        return out, None
    start = time.perf_counter()
    prepare_shards(folder, str(out), workers=workers, overwrite=True, progress=False, print_summary=False)
    return out, time.perf_counter() - start


def _folder_loader(folder: Path, batch: int, workers: int):
    dataset = build_dataset(folder, Minimal())
    return resumable_loader(dataset, batch, collate_train, num_workers=workers, seed=0)


def _shard_loader(shards: Path, batch: int, workers: int):
    return shard_train_loader(
        ShardTrainSet(shards, Minimal(), seed=0), batch, collate_train, num_workers=workers
    )


def measure(make, batch: int, workers: int, batches: int) -> tuple[float, float]:
    """(seconds to the first batch, images/s over the next ``batches`` batches)."""
    start = time.perf_counter()
    iterator = iter(make(batch, workers))
    next(iterator)
    first = time.perf_counter() - start
    start = time.perf_counter()
    images = 0
    for _ in range(batches):
        images += len(next(iterator)[2])
    rate = images / (time.perf_counter() - start)
    del iterator
    return first, rate


def folder_bytes(folder: Path) -> tuple[float, int]:
    sizes = [p.stat().st_size for p in folder.rglob("*.jpg")]
    return sum(sizes) / len(sizes), len(sizes)


def shard_bytes(shards: Path) -> tuple[float, int]:
    import json

    records = json.loads((shards / META_FILE).read_text())["records"]
    chunks = list(shards.glob("*.bin"))
    return sum(c.stat().st_size for c in chunks) / records, len(chunks)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=2000, help="UKBench files (copies), default 2000")
    parser.add_argument("--small", type=int, default=100_000, help="generated 32 px JPEGs, default 100000")
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers (images/s is per worker)")
    parser.add_argument("--prepare-workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=20, help="batches timed after the first")
    parser.add_argument("--repeats", type=int, default=3, help="passes per reader; the median is printed")
    parser.add_argument("--work", type=Path, required=True, help="folder for the images and shards (kept)")
    parser.add_argument("--ukbench", type=Path, default=UKBENCH, help="folder of the UKBench photos")
    parser.add_argument("--reuse", action="store_true", help="reuse shards prepared by an earlier run")
    parser.add_argument("--tiny", action="store_true", help="40 + 400 files, 2 batches of 8 (a smoke run)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.files, args.small, args.batch, args.batches, args.repeats = 40, 400, 8, 2, 1
    torch.set_num_threads(1)
    sets = {
        f"ukbench x{args.files}": ukbench_folder(args.work, args.files, args.ukbench),
        f"32px x{args.small}": small_folder(args.work, args.small),
    }
    rows = []
    for name, folder in sets.items():
        shards, prepare_s = shards_of(folder, args.prepare_workers, args.reuse)
        timing = (args.batch, args.workers, args.batches)
        passes: dict[str, list] = {"folder": [], "shards": []}
        for _ in range(args.repeats):  # interleaved, so that a busy moment of the shared machine hits both
            passes["folder"].append(measure(partial(_folder_loader, folder), *timing))
            passes["shards"].append(measure(partial(_shard_loader, shards), *timing))
        (f_first, f_rate), (s_first, s_rate) = (
            (statistics.median(p[0] for p in runs), statistics.median(p[1] for p in runs))
            for runs in passes.values()
        )
        (f_bytes, f_files), (s_bytes, s_files) = folder_bytes(folder), shard_bytes(shards)
        pairs = [s[1] / f[1] for f, s in zip(passes["folder"], passes["shards"], strict=True)]
        rows.append(dict(name=name, prepare=prepare_s, first=(f_first, s_first), rate=(f_rate, s_rate),
                         pairs=(min(pairs), max(pairs)), bytes=(f_bytes, s_bytes), files=(f_files, s_files)))  # fmt: skip
    print(
        f"workers {args.workers}, batch {args.batch}, {args.batches} batches timed, median of {args.repeats} "
        "passes; folder / shards (ratio)"
    )
    head = f"{'dataset':<16} {'prepare s':>9} | {'first batch s':>22} | {'images/s per worker':>26} | "
    head += f"{'ratio per pass':>14} | "
    print(head + f"{'bytes per image':>26} | {'files per epoch':>16}")
    for r in rows:
        prepare = f"{r['prepare']:.1f}" if r["prepare"] is not None else "reused"
        cells = [
            f"{r['first'][0]:6.2f} / {r['first'][1]:6.2f} ({r['first'][0] / r['first'][1]:4.1f}x)",
            f"{r['rate'][0]:7.0f} / {r['rate'][1]:7.0f} ({r['rate'][1] / r['rate'][0]:4.2f}x)",
            f"{r['pairs'][0]:.2f}-{r['pairs'][1]:.2f}x".rjust(14),
            f"{r['bytes'][0]:8.0f} / {r['bytes'][1]:8.0f} ({r['bytes'][1] / r['bytes'][0]:4.2f}x)",
            f"{r['files'][0]:7d} / {r['files'][1]:6d}",
        ]
        print(f"{r['name']:<16} {prepare:>9} | " + " | ".join(cells))
    return rows


if __name__ == "__main__":
    main()
