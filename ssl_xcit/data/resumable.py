"""A training loader that resumes mid-epoch exactly: the same order, every image once per epoch, on every rank.

Lightning saves a training loader's position in the checkpoint only for a loader with ``state_dict`` and
``load_state_dict`` (``FitLoop.on_save_checkpoint``, ``CombinedLoader._state_dicts``), and restores it before
it creates the resumed epoch's iterator. torchdata's ``StatefulDataLoader`` is such a loader for map-style
datasets: it counts the batches it has handed out, with workers too (each batch's sampler state is
snapshotted when its indices go to a worker, so read-ahead batches are not counted as seen).

What it cannot know is the epoch: Lightning calls ``set_epoch`` only after the resumed iterator exists, and
with workers that iterator has already drawn the first indices of the epoch 0 order. :class:`ResumableSampler`
therefore keeps the epoch and the seed in its own state next to torchdata's position, and orders every epoch
by ``(seed, epoch)`` alone, so the order does not depend on the global RNG or on when the iterator is made.

It is a ``DistributedSampler`` built with the trainer's world size and rank, so Lightning does not replace it
under DDP (it injects its own sampler only into loaders that have none of that type).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from ssl_xcit.errors import UserError

# (seed, epoch, number of batches) -> the index of each batch's crop sizes (ssl_xcit.data.stages.CropMix.pairs)
BatchPairs = Callable[[int, int, int], Any]


class ResumableSampler(StatefulDistributedSampler):
    """Shuffled ``DistributedSampler`` (``drop_last``) whose state is its position, epoch, seed and world size.

    With ``batch_pairs`` (``ssl_xcit.data.stages.CropMix.pairs``) it yields ``(index, pair)``: the pair of the
    index's batch of ``batch_size`` in the epoch, ``batch_pairs(seed, epoch, num_batches)[batch]``, which does
    not depend on the rank.

    ``rank`` ``r`` of ``W`` takes every ``W``-th image of the epoch's permutation of the whole dataset (seeded by
    ``seed + epoch``), as ``DistributedSampler`` does. A state saved mid-epoch resumes only on the same world
    size and dataset size: any other split would repeat or skip images, so that is an error.
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        batch_pairs: BatchPairs | None = None,
        batch_size: int = 1,
    ) -> None:
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.batch_pairs, self.batch_size = batch_pairs, batch_size

    def __iter__(self) -> Iterator[Any]:
        if self.batch_pairs is None:
            yield from super().__iter__()
            return
        # Drawn when the epoch's first index is, from the epoch the permutation uses; a resumed iterator
        # continues from its saved position, and so at the same batch of the same draws.
        pairs = self.batch_pairs(self.seed, self.epoch, len(self) // self.batch_size + 1)
        for index in super().__iter__():  # `yielded` counts this index already
            yield index, int(pairs[(self.yielded - 1) // self.batch_size])

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),  # "yielded": samples of this epoch handed to the loader
            "epoch": self.epoch,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "dataset_size": len(self.dataset),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = (state_dict.get("num_replicas", self.num_replicas), state_dict.get("dataset_size"))
        if saved[0] != self.num_replicas or saved[1] not in (None, len(self.dataset)):
            raise UserError(
                f"the checkpoint was saved mid-epoch with {saved[0]} process(es) on {saved[1]} training images, "
                f"but this run has {self.num_replicas} on {len(self.dataset)}: the rest of that epoch cannot be "
                "split without repeating or skipping images; resume with the same devices and images, or from "
                "an epoch-end checkpoint (a kept epoch=NNNN.ckpt)"
            )
        self.epoch = int(state_dict.get("epoch", self.epoch))
        self.seed = int(state_dict.get("seed", self.seed))
        super().load_state_dict(state_dict)


def run_seed() -> int:
    """The run's seed as every rank sees it: Lightning's ``PL_GLOBAL_SEED`` (set by ``seed_everything`` and
    inherited by the processes it starts), else 0, as Lightning's own ``DistributedSampler`` uses."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def resumable_loader(
    dataset: Dataset,
    batch_size: int,
    collate_fn: Callable[[list[Any]], Any],
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    world_size: int = 1,
    rank: int = 0,
    seed: int | None = None,
    batch_pairs: BatchPairs | None = None,
) -> StatefulDataLoader:
    """A shuffled, ``drop_last`` training loader that Lightning checkpoints and resumes mid-epoch exactly;
    with ``batch_pairs`` its keys are ``(index, pair)`` (:class:`ResumableSampler`)."""
    seed = run_seed() if seed is None else seed
    # Its own generator: a plain DataLoader draws its workers' base seed from the global RNG each time an
    # iterator is made, and the resumed epoch makes one more than an uninterrupted run, so every later
    # augmentation on the main process would differ.
    generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=ResumableSampler(
            dataset, world_size, rank, seed, batch_pairs=batch_pairs, batch_size=batch_size
        ),
        drop_last=True,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers and num_workers > 0,
        collate_fn=collate_fn,
        generator=generator,
        # Workers seeded from (base seed, worker, rank): every rank loads the same loader state (rank 0's) on
        # resume, and its base seed alone would give all ranks' workers the same random streams.
        worker_init_fn=partial(pl_worker_init_function, rank=rank) if num_workers > 0 else None,
    )
