"""Every RNG state a run draws from (torch, CUDA, numpy, Python), as checkpoint-safe values, and back.

The CUDA part is each visible device's default generator (seed and Philox offset: what ``torch.rand`` on that
device draws from next), all of them on every rank, and the index of the rank's own device. A resume with the
same devices visible restores them all; one that sees another number of devices (another
``CUDA_VISIBLE_DEVICES`` layout) restores the state of the device the rank trained on onto the device it
resumes on, the only generator its step draws from.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_states() -> dict[str, Any]:
    """Tensors and plain Python values only, so ``torch.load(weights_only=True)`` accepts the checkpoint."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    cuda = torch.cuda.is_available()
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
        "cuda": torch.cuda.get_rng_state_all() if cuda else [],
        "cuda_device": torch.cuda.current_device() if cuda else -1,
    }


def restore_rng_states(state: dict[str, Any] | None) -> None:
    """Undo :func:`capture_rng_states`; None does nothing. CUDA: every device's generator when as many devices
    are visible as at the capture, else the captured own device's onto the current device (a checkpoint from
    before ``cuda_device`` was kept: none then)."""
    if not state:
        return
    torch.set_rng_state(state["torch"])
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_kind, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    cuda_states = state.get("cuda") or []
    if not cuda_states or not torch.cuda.is_available():
        return
    if len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda_states)
        return
    own = state.get("cuda_device", -1)
    if 0 <= own < len(cuda_states):
        torch.cuda.set_rng_state(cuda_states[own], torch.cuda.current_device())


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
