"""Gradient accumulation under DDP: one gradient all-reduce per window, the same gradients as reducing every
micro-batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import torchrun

WORKER = Path(__file__).with_name("accumulation_worker.py")


@pytest.mark.slow  # ~30 s on 2 cores: two 2-process runs
@pytest.mark.distributed
def test_accumulation_reduces_gradients_once_per_window(tmp_path):
    torchrun(WORKER, str(tmp_path), timeout=180)
    for rank in range(2):
        windowed, every = (
            torch.load(tmp_path / f"{n}_rank{rank}.pt", weights_only=True) for n in ("windowed", "every")
        )
        assert windowed["global_step"] == every["global_step"] == 2
        # DDP reduces in buckets (one call of the hook each), and rebuilds them after its first backward.
        assert all(n >= 1 for n in every["per_batch"]), every["per_batch"]  # the reference: every micro-batch
        assert windowed["per_batch"][0::2] == [0, 0], windowed["per_batch"]  # nothing inside a window
        assert min(windowed["per_batch"][1::2]) >= 1  # at each window's end
        # All buckets once DDP has rebuilt them.
        assert windowed["per_batch"][-1] == every["per_batch"][-1]
        assert len(windowed["grads"]) == len(every["grads"]) == 2
        for ours, reference in zip(windowed["grads"], every["grads"], strict=True):
            assert ours.keys() == reference.keys() and len(ours) > 10
            for name, grad in reference.items():
                torch.testing.assert_close(ours[name], grad, rtol=1e-5, atol=1e-7, msg=name)
