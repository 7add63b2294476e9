"""HSDP under ``--trainer.strategy fsdp2`` (``FSDP2Strategy(replicate_degree=N)``, ``ssl_xcit.parallel.fsdp``): 4
gloo processes as 2 replica groups x 2 shards train exactly as FSDP2 over all 4 ranks and as DDP, within float32
reduction order, with gradient clipping on (its norms summed over the shards only, not the replicas)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import _dino

WORKER = Path(__file__).with_name("hsdp_worker.py")


@pytest.mark.slow
@pytest.mark.distributed
def test_hsdp_2x2_equals_fsdp2_and_ddp_on_4_processes(tmp_path):
    _dino.torchrun(WORKER, str(tmp_path), nproc=4, timeout=900)
    load = lambda run, r: torch.load(tmp_path / run / f"rank{r}.pt", weights_only=True)  # noqa: E731
    for rank in range(4):
        ddp, fsdp, hsdp = load("ddp", rank), load("fsdp2", rank), load("hsdp", rank)
        assert hsdp["placements"] == ["R", "S(0)"] and fsdp["placements"] == ["S(0)"]  # 2-D: HSDP
        assert ddp["global_step"] == fsdp["global_step"] == hsdp["global_step"] == 2
        for other in (fsdp, ddp):
            torch.testing.assert_close(hsdp["losses"], other["losses"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(hsdp["centers"], other["centers"], rtol=1e-5, atol=1e-6)
            for net in ("student", "teacher"):
                assert hsdp[net].keys() == other[net].keys()
                for key, value in hsdp[net].items():
                    torch.testing.assert_close(value, other[net][key], rtol=1e-4, atol=1e-6, msg=key)
        # the weights moved: not a comparison of two untouched initialisations
        moved = [
            (hsdp["student"][k] - v).abs().max() for k, v in hsdp["initial"].items() if v.is_floating_point()
        ]
        assert max(moved) > 1e-3
