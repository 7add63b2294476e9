"""LinearProbe: frozen backbone, head init, lr scaling + cosine, independent heads, learning on features."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ssl_xcit.evaluation.linear import LinearProbe

from .helpers import ARCH

TRAINER = dict(
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
)


def blobs(n_per_class: int, num_classes: int = 5, dim: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    centres = 3.0 * torch.randn(num_classes, dim, generator=g)
    y = torch.arange(num_classes).repeat_interleave(n_per_class)
    x = centres[y] + torch.randn(len(y), dim, generator=g)
    return x, y


def fit(model: LinearProbe, x, y, xv, yv, epochs: int, batch_size: int = 16) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    loader = DataLoader(
        TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    model.write_on_fit_end = False
    trainer = pl.Trainer(max_epochs=epochs, **TRAINER)
    trainer.fit(model, loader, DataLoader(TensorDataset(xv, yv), batch_size=64))
    return trainer


def test_backbone_frozen_in_eval_mode_and_unchanged_by_training():
    probe = LinearProbe(arch=ARCH, num_classes=3, lrs=[0.1], per_device_batch_size=4)
    before = {k: v.clone() for k, v in probe.backbone.state_dict().items()}  # includes BN running stats
    assert not any(p.requires_grad for p in probe.backbone.parameters())
    probe.train()
    assert not any(m.training for m in probe.backbone.modules()) and probe.heads.training
    head = probe.heads[0]
    assert head.bias.abs().sum() == 0 and 0.007 < head.weight.std() < 0.013  # N(0, 0.01) as DINO
    images = torch.randn(8, 3, 32, 32)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    w0 = head.weight.clone()
    fit(probe, images, labels, images, labels, epochs=2, batch_size=4)
    assert not torch.equal(head.weight, w0)
    for k, v in probe.backbone.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_backbone_in_eval_mode_during_fit_even_if_left_in_train_mode():
    """Lightning 2.6 calls no train()/eval() during fit: the probe itself must put the backbone in eval mode."""

    class Recorder(pl.Callback):
        modes: list[bool] = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.modes.append(any(m.training for m in module.backbone.modules()))

    probe = LinearProbe(arch=ARCH, num_classes=3, lrs=[0.1], per_device_batch_size=4)
    probe.backbone.train()  # e.g. a caller's backbone.train(), or a module shared with a training run
    images, labels = torch.randn(8, 3, 32, 32), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    recorder = Recorder()
    loader = DataLoader(TensorDataset(images, labels), batch_size=4)
    probe.write_on_fit_end = False
    pl.Trainer(max_epochs=2, callbacks=[recorder], **TRAINER).fit(probe, loader, loader)
    assert recorder.modes == [False] * 4


def test_lr_scaling_and_cosine_to_zero():
    x, y = blobs(8)
    probe = LinearProbe(num_classes=5, feature_dim=16, lrs=[0.01, 0.1], per_device_batch_size=16)
    trainer = fit(probe, x, y, x, y, epochs=3)
    groups = trainer.optimizers[0].param_groups
    assert [g["initial_lr"] for g in groups] == pytest.approx([0.01 * 16 / 256, 0.1 * 16 / 256])
    assert [g["lr"] for g in groups] == pytest.approx([0.0, 0.0], abs=1e-12)  # cosine ends at 0
    assert groups[0]["momentum"] == 0.9 and groups[0]["weight_decay"] == 0.0
    assert probe.results["per_lr"][1]["lr"] == pytest.approx(0.1 * 16 / 256)


def test_heads_train_independently():
    # A head trained next to another (larger-lr) head ends exactly where it ends when trained alone.
    x, y = blobs(10)
    torch.manual_seed(0)
    pair = LinearProbe(num_classes=5, feature_dim=16, lrs=[1.0, 30.0], per_device_batch_size=16)
    torch.manual_seed(0)
    alone = LinearProbe(num_classes=5, feature_dim=16, lrs=[1.0], per_device_batch_size=16)
    torch.testing.assert_close(pair.heads[0].weight, alone.heads[0].weight)
    fit(pair, x, y, x, y, epochs=2)
    fit(alone, x, y, x, y, epochs=2)
    torch.testing.assert_close(pair.heads[0].weight, alone.heads[0].weight)
    torch.testing.assert_close(pair.heads[0].bias, alone.heads[0].bias)
    assert not torch.allclose(pair.heads[0].weight, pair.heads[1].weight)


def test_probe_learns_separable_features_far_above_chance():
    x, y = blobs(40, seed=1)
    xv, yv = blobs(20, seed=1)  # same centres as train (same seed); extra noise so val is not a train subset
    xv = xv + 0.5 * torch.randn_like(xv)
    probe = LinearProbe(num_classes=5, feature_dim=16, lrs=[1e-4, 0.5, 5.0], per_device_batch_size=16)
    fit(probe, x, y, xv, yv, epochs=10)
    rows = probe.results["per_lr"]
    assert probe.results["best"]["top1"] >= 95.0  # chance is 20 %
    assert rows[0]["top1"] < probe.results["best"]["top1"]  # the tiny lr barely moves from N(0, 0.01)
    assert probe.results["best"] == max(rows, key=lambda r: r["top1"])
    assert all(r["top5"] == 100.0 for r in rows)  # 5 classes: top-5 is always right


def test_bad_probe_arguments(tmp_path):
    with pytest.raises(ValueError, match="lrs must be positive numbers"):
        LinearProbe(num_classes=3, feature_dim=4, lrs=[0.1, -1.0])
    with pytest.raises(ValueError, match="at least 2 classes, got 1"):
        LinearProbe(num_classes=1, feature_dim=4)
    with pytest.raises(FileNotFoundError, match="weights file not found: .*nope.pth"):
        LinearProbe(weights=str(tmp_path / "nope.pth"), num_classes=3)
    with pytest.raises(ValueError, match="--arch NAME to evaluate a randomly initialised backbone"):
        LinearProbe(num_classes=3)
