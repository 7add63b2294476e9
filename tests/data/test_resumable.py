"""The resumable training loader: the order of every epoch, and a mid-epoch state that resumes exactly."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler

from ssl_xcit.data.datasets import collate_train
from ssl_xcit.data.resumable import ResumableSampler, resumable_loader
from ssl_xcit.errors import UserError


class Items(Dataset):
    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return [torch.full((1,), float(i))], -1, i


def _indices(batches) -> list[int]:
    return [i for b in batches for i in b[2].tolist()]


@pytest.mark.parametrize("rank", [0, 1])
def test_each_epoch_is_torchs_distributed_order_for_that_rank(rank):
    data = Items(41)
    ours, torchs = ResumableSampler(data, 2, rank, seed=7), DistributedSampler(data, 2, rank, True, 7, True)
    for epoch in (0, 3):
        ours.set_epoch(epoch)
        torchs.set_epoch(epoch)
        assert list(ours) == list(torchs) and len(list(ours)) == 20


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mid_epoch_state_resumes_the_same_epoch_in_a_fresh_loader(workers):
    """Epoch 1, 3 of 10 batches taken: a new loader given the state yields the other 7, in order, even though
    its sampler is at epoch 0 when its iterator is made (Lightning sets the epoch only afterwards)."""
    data = Items(40)
    first = resumable_loader(data, 4, collate_train, num_workers=workers, seed=3)
    first.sampler.set_epoch(1)
    whole = _indices(first)
    first.sampler.set_epoch(1)
    iterator = iter(first)
    taken = [next(iterator) for _ in range(3)]
    state = first.state_dict()
    del iterator

    second = resumable_loader(data, 4, collate_train, num_workers=workers, seed=3)
    second.load_state_dict(state)
    rest = list(second)
    assert _indices(taken) + _indices(rest) == whole
    assert sorted(whole) == list(range(40))
    assert len(second) == 10  # the epoch's length is unchanged (Lightning sizes schedules from it)


def test_a_state_from_another_world_size_is_refused_naming_both():
    state = ResumableSampler(Items(40), num_replicas=2, rank=0).state_dict()
    with pytest.raises(
        UserError, match=r"saved mid-epoch with 2 process\(es\) on 40 .* this run has 1 on 40"
    ):
        ResumableSampler(Items(40), num_replicas=1, rank=0).load_state_dict(state)
    with pytest.raises(UserError, match=r"on 40 training images, but this run has 2 on 41"):
        ResumableSampler(Items(41), num_replicas=2, rank=0).load_state_dict(state)
