"""Cost per step of the resumable training loader against a plain shuffled DataLoader, side by side.

"plain" is ``DataLoader(shuffle=True, drop_last=True)`` (the training loader before issue 31); "resumable" is
``ssl_xcit.data.resumable.resumable_loader``: torchdata's ``StatefulDataLoader``, which snapshots the sampler
state with every batch (and, with workers, has every worker send its state back), plus our sampler. Both
load the same images with the same DINO multi-crop transform (``augment_on=cpu``: decode, crop, colour
jitter, blur, ...) for the same number of batches, per number of workers; the median of ``--repeats``
passes is printed, with the ratio resumable / plain, and the time of one ``state_dict()`` (what a checkpoint
adds). Timing starts after the first batch (worker start-up excluded).

Run from the repository root (images from ../shared/data/flowers5, 128 px JPEGs):

    python benchmarks/bench_resumable_loader.py
    python benchmarks/bench_resumable_loader.py --workers 0 2 --batches 30 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from ssl_xcit.data.datasets import build_dataset, collate_train
from ssl_xcit.data.resumable import resumable_loader
from ssl_xcit.data.transforms import MultiCropTransform

ROOT = Path(__file__).resolve().parents[1]


class _Trivial(torch.utils.data.Dataset):
    """Items that cost nothing to make: what is left is each loader's own bookkeeping per batch."""

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int):
        return [torch.zeros(1)], -1, i


def _dataset(root: Path):
    transform = MultiCropTransform(
        global_crops_size=96, local_crops_number=4, local_crops_size=48, global_crops_scale=(0.4, 1.0)
    )
    dataset = build_dataset(root)
    dataset.transform = transform
    return dataset


def _loaders(dataset, batch: int, workers: int) -> dict[str, DataLoader]:
    plain = DataLoader(
        dataset,
        batch_size=batch,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        collate_fn=collate_train,
        persistent_workers=workers > 0,
    )
    resumable = resumable_loader(
        dataset, batch, collate_train, num_workers=workers, persistent_workers=workers > 0
    )
    return {"plain": plain, "resumable": resumable}


def _seconds_per_batch(loader: DataLoader, batches: int) -> float:
    iterator = iter(loader)
    next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return (time.perf_counter() - start) / batches


def _state_dict_ms(loader: DataLoader) -> float:
    if not hasattr(loader, "state_dict"):
        return float("nan")
    iterator = iter(loader)
    next(iterator)
    start = time.perf_counter()
    for _ in range(20):
        loader.state_dict()
    return (time.perf_counter() - start) / 20 * 1000


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "flowers5")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _table(_dataset(args.data), f"images from {args.data}", args, args.batches)
    _table(_Trivial(), "trivial items (bookkeeping only)", args, args.batches * 50)


def _table(dataset, what: str, args: argparse.Namespace, batches: int) -> None:
    print(f"{len(dataset)} {what}, batch {args.batch}, {batches} batches x {args.repeats}")
    print(
        f"{'workers':>7}  {'plain ms/batch':>14}  {'resumable ms/batch':>18}  {'ratio':>6}  {'state_dict ms':>13}"
    )
    for workers in args.workers:
        times: dict[str, list[float]] = {"plain": [], "resumable": []}
        for _ in range(args.repeats):  # alternate, so drift on a shared machine hits both alike
            for name, loader in _loaders(dataset, args.batch, workers).items():
                times[name].append(_seconds_per_batch(loader, batches))
        plain, resumable = (statistics.median(times[k]) * 1000 for k in ("plain", "resumable"))
        state_ms = _state_dict_ms(_loaders(dataset, args.batch, workers)["resumable"])
        print(
            f"{workers:>7}  {plain:>14.3f}  {resumable:>18.3f}  {resumable / plain:>6.3f}  {state_ms:>13.3f}"
        )


if __name__ == "__main__":
    main()
