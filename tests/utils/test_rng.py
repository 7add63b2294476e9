from __future__ import annotations

from ssl_xcit.utils.rng import gather_rng_states, own_rng_states


def test_each_rank_restores_its_own_states_when_the_world_size_is_unchanged():
    checkpoint = {"rng_states": "rank 0", "rng_states_per_rank": ["rank 0", "rank 1"]}
    assert [own_rng_states(checkpoint, r, 2) for r in (0, 1)] == ["rank 0", "rank 1"]
    # Another world size, or a checkpoint from before per-rank states: rank 0's, as Lightning would.
    assert own_rng_states(checkpoint, 1, 4) == "rank 0"
    assert own_rng_states({"rng_states": "rank 0"}, 1, 2) == "rank 0"
    assert own_rng_states({}, 0, 1) is None


def test_one_process_gathers_nothing():
    assert gather_rng_states({"torch": None}) is None
