"""Host facts to the device without waiting on it.

A plain ``tensor.to("cuda")`` of pageable host memory copies synchronously: the host waits until the GPU
queue has drained, so the next step's kernels cannot be queued ahead. A copy from pinned (page-locked) memory
with ``non_blocking=True`` is queued on the stream like a kernel; torch's caching host allocator keeps the
pinned block alive until the copy has run, so a fresh pinned tensor per call is safe and cheap.
"""

from __future__ import annotations

import numpy as np
import torch


def host_to_device(value: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value`` (a host array or CPU tensor) on ``device``, queued without a host sync on CUDA."""
    tensor = torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value
    # On the CPU `to` returns the tensor itself; called there too, so the CPU runs the GPU's path (the loop
    # census, tests/dino/loop_census.py, tells a host tensor from a device one by that call).
    if device.type == "cuda" and torch.cuda.is_available():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def scalars_to_device(values: dict[str, float], device: torch.device) -> dict[str, torch.Tensor]:
    """Host scalars (schedule values, counters) as 0-d float32 device tensors, in one non-blocking copy.

    Lightning's ``self.log`` of a Python number builds ``torch.tensor(value, device=...)``: one blocking copy,
    so one host sync, per logged number and step."""
    vector = host_to_device(np.asarray(list(values.values()), dtype=np.float32), device)
    return dict(zip(values, vector.unbind(), strict=True))
