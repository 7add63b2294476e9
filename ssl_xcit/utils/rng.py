"""Every RNG state a run draws from (torch, CUDA, numpy, Python), as checkpoint-safe values, and back."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_states() -> dict[str, Any]:
    """Tensors and plain Python values only, so ``torch.load(weights_only=True)`` accepts the checkpoint."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": [
            np_kind,
            torch.from_numpy(np_keys.astype(np.int64)),
            int(np_pos),
            int(np_has_gauss),
            float(np_gauss),
        ],
        "python": [py_version, list(py_state), py_gauss],
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_states(state: dict[str, Any] | None) -> None:
    """Undo :func:`capture_rng_states` (CUDA states only when the device count matches); None does nothing."""
    if not state:
        return
    torch.set_rng_state(state["torch"])
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_kind, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather_rng_states(states: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's :func:`capture_rng_states`, by global rank (a collective); None without several processes.
    Each rank draws from its own streams (its own GPU's generator above all), so a checkpoint that kept rank
    0's alone would rewind the others on resume."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, states)  # once per checkpoint: a host round trip is fine here
    return gathered


def own_rng_states(checkpoint: dict[str, Any], rank: int, world_size: int) -> dict[str, Any] | None:
    """The states this rank saved (``rng_states_per_rank``) when the world size is unchanged, else the
    checkpoint's ``rng_states`` (rank 0's; a checkpoint from before per-rank states, or another world size)."""
    per_rank = checkpoint.get("rng_states_per_rank")
    if per_rank and len(per_rank) == world_size and 0 <= rank < world_size:
        return per_rank[rank]
    return checkpoint.get("rng_states")
