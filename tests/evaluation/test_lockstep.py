"""``lockstep_batches``: every rank of a split evaluation pass forwards as often as every other (issue 52).

A sharded (FSDP2) network all-gathers its parameters in every forward, so a rank with one batch more would
wait in a collective the others never enter. Here each rank's batches are listed in one process; the 2-process
runs of the monitors are in tests/trainer/test_sharded_eval.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

from ssl_xcit.evaluation.embed import embed_dataset, lockstep_batches, lockstep_plan


class Indexed(Dataset):
    """Image i is a 1 x 2 x 2 tensor filled with i and labelled i; ``None`` (unreadable) at ``unreadable``."""

    def __init__(self, n: int, unreadable: frozenset[int] | set[int] = frozenset()) -> None:
        self.n, self.unreadable = n, frozenset(unreadable)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return None if i in self.unreadable else (torch.full((1, 2, 2), float(i)), i)


def walk(dataset: Dataset, world: int, batch: int) -> tuple[list[int], list[int]]:
    """Each rank's forward count, and the real rows of all ranks in rank order (as image ids)."""
    counts, rows = [], []
    for rank in range(world):
        batches = list(lockstep_batches(dataset, batch_size=batch, rank=rank, world_size=world))
        counts.append(len(batches))
        for b in batches:
            assert len(b.images) >= 1 and len(b.labels) == b.real  # a padding batch still has an image
            ids = b.images[: b.real, 0, 0, 0].long().tolist()
            assert ids == b.labels.tolist()
            rows += ids
    return counts, rows


@pytest.mark.parametrize(
    ("n", "world", "batch", "unreadable"),
    [
        (129, 2, 64, set()),  # the repro: 65 and 64 images, 2 batches against 1
        (129, 2, 64, {64}),  # rank 0's second batch holds only an unreadable image
        (129, 2, 64, set(range(64))),  # rank 0's first batch unreadable: its padding comes from later
        (3, 4, 2, set()),  # rank 3's share is empty
        (10, 3, 2, set(range(8))),  # rank 0 and 1 read nothing: padding found in rank 2's share
        (8, 2, 4, set(range(8))),  # nothing readable anywhere: no rank forwards
        (130, 2, 64, set()),  # even: no padding
    ],
)
def test_every_rank_forwards_equally_and_the_rows_are_the_dataset(n, world, batch, unreadable):
    counts, rows = walk(Indexed(n, unreadable), world, batch)
    readable = [i for i in range(n) if i not in unreadable]
    assert rows == readable  # every readable image once, in dataset order
    expected = lockstep_plan(n, world, batch)[1] if readable else 0
    assert counts == [expected] * world


def test_imagenet_val_on_64_ranks():
    """50,000 images, 64 ranks, batch 128: shares of 782 (7 batches); the last rank has 734 (6), and pads."""
    assert lockstep_plan(50_000, 64, 128) == (782, 7)
    last = list(lockstep_batches(Indexed(50_000), batch_size=128, rank=63, world_size=64))
    assert len(last) == 7 and [b.real for b in last] == [128] * 5 + [94, 0]
    assert last[0].images[0, 0, 0, 0] == 63 * 782


def test_one_process_skips_unreadable_batches_and_embeds_as_before():
    dataset = Indexed(10, set(range(4, 8)))
    assert [b.real for b in lockstep_batches(dataset, batch_size=4)] == [4, 2]  # batch 4-7 skipped
    out = embed_dataset(lambda x: x.flatten(1), dataset, batch_size=4)
    assert out["labels"].tolist() == [0, 1, 2, 3, 8, 9] == out["features"][:, 0].long().tolist()


def test_sharded_embeddings_concatenate_to_the_whole():
    """``embed_dataset`` on each rank's share: the padding is dropped, the shares join into the whole."""
    dataset = Indexed(129, {64})
    whole = embed_dataset(lambda x: x.flatten(1), dataset, batch_size=64)
    calls = []

    def model(x):
        calls.append(len(x))
        return x.flatten(1)

    shares = [
        embed_dataset(model, dataset, batch_size=64, rank=r, world_size=2, allow_empty=True) for r in (0, 1)
    ]
    assert calls == [64, 2, 64, 2]  # rank 0: 0-63, then padding (64 is unreadable); rank 1: 65-128, padding
    torch.testing.assert_close(torch.cat([s["features"] for s in shares]), whole["features"])
    assert torch.cat([s["labels"] for s in shares]).tolist() == whole["labels"].tolist()
