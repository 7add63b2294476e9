from __future__ import annotations

import types

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from ssl_xcit.trainer.callbacks import OnlineKNN


class Points(Dataset):
    """Two well-separated classes (+-1 along one axis, plus small noise); labelled."""

    labelled = True

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.y = torch.arange(n) % 2
        self.x = torch.randn(n, 4, generator=g) * 0.1
        self.x[:, 0] += self.y * 2.0 - 1.0
        self.targets = self.y.tolist()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i]), i


class ModeSpy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.modes = []

    def forward(self, x):
        self.modes.append(self.training)
        return x


def _fake(datamodule):
    backbone = ModeSpy()
    module = types.SimpleNamespace(
        teacher=types.SimpleNamespace(backbone=backbone), device=torch.device("cpu")
    )
    trainer = types.SimpleNamespace(
        datamodule=datamodule, is_global_zero=True, current_epoch=3, global_step=7
    )
    return trainer, module, backbone


def test_knn_on_separable_features_and_mode_restored():
    dm = types.SimpleNamespace(knn_datasets=lambda: (Points(40, 0), Points(20, 1)))
    trainer, module, backbone = _fake(dm)
    backbone.train()
    callback = OnlineKNN(k=5, batch_size=16)
    assert callback.evaluate(trainer, module) == pytest.approx(100.0)
    assert backbone.modes and not any(backbone.modes)  # features in eval mode
    assert backbone.training  # previous mode restored
    assert callback.history == [{"epoch": 3, "step": 7, "top1": 100.0}]


def test_knn_disabled_with_a_message_without_labels():
    trainer, module, _ = _fake(types.SimpleNamespace(knn_datasets=lambda: None))
    callback = OnlineKNN()
    with pytest.warns(UserWarning, match="Online k-NN disabled: the datamodule has no labelled"):
        assert callback.evaluate(trainer, module) is None
    trainer, module, _ = _fake(object())
    with pytest.warns(UserWarning, match="has no knn_datasets"):
        assert OnlineKNN().evaluate(trainer, module) is None
