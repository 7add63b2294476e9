"""``--model.init_from FOLDER`` of a sharded checkpoint into a sharded (``fsdp2``) run reads straight into the
model's shards (``ssl_xcit.dino.init_from.ShardedSource``): on 2 gloo processes every planned element of the
folder is read exactly once over both ranks (a whole read on each rank reads each twice), and the networks,
heads and centre equal the folder's tensors, also with ``init_from_ema`` (both networks from the teacher)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import torchrun

from ssl_xcit.dino.module import DINO
from ssl_xcit.models.sharded import write_sharded_checkpoint

WORKER = Path(__file__).with_name("init_from_sharded_worker.py")
HPARAMS = {"backbone_kwargs": {"depth": 1}, "out_dim": 32, "head_hidden_dim": 32, "head_bottleneck_dim": 16}


def _source(folder: Path) -> tuple[dict[str, torch.Tensor], set[str]]:
    """A DINO checkpoint of other weights than the worker's seed (random values everywhere, not the init),
    written in Lightning's sharded layout; returns its state dict and which keys are parameters (FSDP2
    shards parameters; buffers, BatchNorm's statistics and the centre, are whole on every rank)."""
    L.seed_everything(5, verbose=False)
    model = DINO("xcit_nano_12_p8", **HPARAMS)
    g = torch.Generator().manual_seed(3)
    state = {k: torch.randn(v.shape, generator=g) if v.is_floating_point() else v
             for k, v in model.state_dict().items()}  # fmt: skip
    checkpoint = {
        "state_dict": state,
        "hyper_parameters": {"backbone": "xcit_nano_12_p8", **HPARAMS},
        "epoch": 0,
    }
    write_sharded_checkpoint(checkpoint, folder)
    return state, {name for name, _ in model.named_parameters()}


@pytest.mark.distributed
@pytest.mark.slow  # ~12 s a case: 2 processes (the default suite's budget)
@pytest.mark.parametrize("ema", [False, True], ids=["own-sides", "init_from_ema"])
def test_sharded_source_reads_each_element_once(tmp_path, ema):
    state, parameters = _source(tmp_path / "source.ckpt")
    torchrun(WORKER, str(tmp_path / "source.ckpt"), str(tmp_path), "1" if ema else "0", timeout=240)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0]["sharded"] == ["DTensor"]
    for side in ("student", "teacher"):
        source_side = "teacher" if ema else side
        expected = {k[len(source_side) + 1 :]: v for k, v in state.items() if k.startswith(source_side + ".")}
        for rank in ranks:
            got = rank[side]
            assert got.keys() == expected.keys()
            for key, value in expected.items():
                assert torch.equal(got[key], value), (side, key)
    assert all(torch.equal(r["center"], state["dino_loss.center"]) for r in ranks)
    assert ranks[0]["init_state"]["head_warmup_steps"] == 0  # heads came from the folder: no warm-up
    # Each parameter element read once over both ranks, each buffer element once per rank: the ranks' read
    # items add up to exactly that (a whole read on every rank would read each parameter element twice).
    read = Counter()
    for rank in ranks:
        for key, numel in rank["reads"]:
            read[key.removeprefix("state_dict.")] += numel
    sides = ("teacher",) if ema else ("student", "teacher")
    wanted = {
        k: v.numel() * (1 if k in parameters else 2)
        for k, v in state.items()
        if k.split(".")[0] in sides or k == "dino_loss.center"
    }
    assert sum(n for k, n in wanted.items() if k in parameters) > 0.9 * sum(wanted.values())
    assert dict(read) == wanted
