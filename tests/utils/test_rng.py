from __future__ import annotations

import random

import numpy as np
import torch

from ssl_xcit.utils.rng import (
    capture_rng_states,
    gather_rng_states,
    own_rng_states,
    restore_rng_states,
)


def test_each_rank_restores_its_own_states_when_the_world_size_is_unchanged():
    checkpoint = {"rng_states": "rank 0", "rng_states_per_rank": ["rank 0", "rank 1"]}
    assert [own_rng_states(checkpoint, r, 2) for r in (0, 1)] == ["rank 0", "rank 1"]
    # Another world size, or a checkpoint from before per-rank states: rank 0's, as Lightning would.
    assert own_rng_states(checkpoint, 1, 4) == "rank 0"
    assert own_rng_states({"rng_states": "rank 0"}, 1, 2) == "rank 0"
    assert own_rng_states({}, 0, 1) is None


def test_one_process_gathers_nothing():
    assert gather_rng_states({"torch": None}) is None


def test_cpu_streams_round_trip_through_a_weights_only_checkpoint(tmp_path):
    torch.save({"rng_states": capture_rng_states()}, tmp_path / "c.pt")
    first = (torch.rand(3), np.random.rand(), random.random())
    restore_rng_states(torch.load(tmp_path / "c.pt", weights_only=True)["rng_states"])
    again = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]


class FakeCuda:
    """torch.cuda's RNG functions over ``count`` fake devices, each device's state a 1-element uint8 tensor."""

    def __init__(self, count: int, current: int) -> None:
        self.count, self.current = count, current
        self.states = [torch.tensor([10 + d], dtype=torch.uint8) for d in range(count)]

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states])
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: self._set_all(states))
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: self._set(state, device))

    def _set_all(self, states) -> None:
        self.states = [s.clone() for s in states]

    def _set(self, state, device) -> None:
        self.states[device] = state.clone()


def test_every_cuda_device_generator_is_captured_with_the_rank_s_own_device(monkeypatch):
    cuda = FakeCuda(count=4, current=2)  # rank 2 of a node, all 4 GPUs visible
    cuda.install(monkeypatch)
    saved = capture_rng_states()
    assert [int(s) for s in saved["cuda"]] == [10, 11, 12, 13] and saved["cuda_device"] == 2
    cuda.states = [torch.tensor([0], dtype=torch.uint8) for _ in range(4)]  # every generator drew on
    restore_rng_states(saved)
    assert [int(s) for s in cuda.states] == [10, 11, 12, 13]  # all of them back, not only the current one


def test_another_device_layout_restores_the_own_device_onto_the_current_one(monkeypatch):
    saved = FakeCuda(count=4, current=2)
    saved.install(monkeypatch)
    state = capture_rng_states()
    resumed = FakeCuda(count=1, current=0)  # CUDA_VISIBLE_DEVICES=2 on resume: the rank sees one device
    resumed.install(monkeypatch)
    restore_rng_states(state)
    assert [int(s) for s in resumed.states] == [12]
    # A checkpoint from before cuda_device was kept restores no CUDA state under another layout.
    resumed.states = [torch.tensor([0], dtype=torch.uint8)]
    restore_rng_states({k: v for k, v in state.items() if k != "cuda_device"})
    assert [int(s) for s in resumed.states] == [0]


def test_without_cuda_no_cuda_state_is_kept_or_set(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    state = capture_rng_states()
    assert state["cuda"] == [] and state["cuda_device"] == -1

    def refuse(*args):
        raise AssertionError("no CUDA state may be set without CUDA")

    monkeypatch.setattr(torch.cuda, "set_rng_state_all", refuse)
    monkeypatch.setattr(torch.cuda, "set_rng_state", refuse)
    restore_rng_states({**state, "cuda": [torch.zeros(1, dtype=torch.uint8)], "cuda_device": 0})
