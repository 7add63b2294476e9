from __future__ import annotations

import pytest
import torch
from torch import nn

from ssl_xcit.parallel.syncbn import AllReduceBatchNorm, convert_sync_batchnorm
from ssl_xcit.trainer.checkpointing import AtomicCheckpointIO


def test_cpu_conversion_shares_parameters_and_keeps_keys():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm1d(2)))
    weight = model[1].weight
    keys = list(model.state_dict())
    converted = convert_sync_batchnorm(model)
    assert isinstance(converted[1], AllReduceBatchNorm) and isinstance(converted[2][0], AllReduceBatchNorm)
    assert converted[1].weight is weight and list(converted.state_dict()) == keys


def test_allreduce_batchnorm_without_process_group_is_plain_batchnorm():
    bn, ours = nn.BatchNorm2d(4), AllReduceBatchNorm(4)
    x = torch.randn(6, 4, 3, 3)
    torch.testing.assert_close(ours(x), bn(x))
    torch.testing.assert_close(ours.running_var, bn.running_var)


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("simulated crash while writing")


def test_failed_checkpoint_write_leaves_previous_file_intact(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"epoch": 1, "w": torch.ones(3)}, path)
    before = path.read_bytes()
    with pytest.raises(RuntimeError, match="simulated crash"):
        io.save_checkpoint({"epoch": 2, "w": torch.zeros(3), "bad": _Unpicklable()}, path)
    assert path.read_bytes() == before
    assert torch.load(path, weights_only=True)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary left behind
