"""``DINODataModule(augment_on=...)``: uint8 crops from the loader, augmented after the device transfer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ssl_xcit.data.datamodule import DINODataModule

SMALL_CROPS = dict(global_crops_size=16, local_crops_size=8, local_crops_number=2, num_workers=0)


def make_tree(root: Path, per_class: int = 6, size: int = 40) -> Path:
    rng = np.random.default_rng(0)
    for name in ("ant", "bee"):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(
                root / name / f"{i}.jpg"
            )
    return root


@pytest.fixture
def root(tmp_path):
    return str(make_tree(tmp_path / "data"))


@pytest.mark.parametrize("decode_on", ["worker", "device"])
def test_device_mode_loader_gives_uint8_images_and_boxes_and_the_hook_normalised_crops(root, decode_on):
    dm = DINODataModule(root=root, batch_size=4, augment_on="device", decode_on=decode_on, **SMALL_CROPS)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    images = batch[0]
    if decode_on == "worker":
        assert (
            images.images.dtype == torch.uint8
            and images.images.shape == (4, 3, 40, 40)
            and not images.encoded
        )
    else:
        assert images.images is None and len(images.encoded) == 4 and images.encoded[0].dtype == torch.uint8
    assert images.rois.shape == (4 * 4, 5) and images.flips.shape == (16,)
    out = dm.on_after_batch_transfer(batch, 0)
    assert [tuple(c.shape) for c in out[0]] == [(4, 3, 16, 16)] * 2 + [(4, 3, 8, 8)] * 2
    assert all(c.dtype == torch.float32 for c in out[0])
    assert torch.equal(out[1], batch[1]) and torch.equal(out[2], batch[2])
    # Normalised: roughly ImageNet-standardised values, not [0, 255] or [0, 1].
    values = torch.cat([c.flatten() for c in out[0]])
    assert values.min() < -0.5 and values.max() > 1.0 and values.abs().max() < 3.0


def test_cpu_mode_leaves_batches_alone(root):
    dm = DINODataModule(root=root, batch_size=4, augment_on="cpu", **SMALL_CROPS)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert all(c.dtype == torch.float32 for c in batch[0])
    assert dm.on_after_batch_transfer(batch, 0) is batch


def test_device_mode_refuses_float_crops(root):
    dm = DINODataModule(root=root, batch_size=4, augment_on="device", **SMALL_CROPS)
    with pytest.raises(TypeError, match="uint8 crops"):
        dm.on_after_batch_transfer([[torch.rand(2, 3, 16, 16)] * 2, torch.zeros(2), torch.zeros(2)], 0)


def test_augment_on_is_checked_with_the_valid_values(root):
    with pytest.raises(ValueError, match=r"augment_on must be 'auto', 'cpu' .* or 'device' .*got 'gpu'"):
        DINODataModule(root=root, augment_on="gpu", **SMALL_CROPS)
    with pytest.raises(ValueError, match="hue"):
        DINODataModule(root=root, color_jitter=(0.4, 0.4, 0.2, 0.7), **SMALL_CROPS)


def test_run_seed_read_once_and_restored_from_the_checkpoint_and_old_checkpoints_load(root):
    torch.manual_seed(123)
    dm = DINODataModule(root=root, batch_size=4, augment_on="device", **SMALL_CROPS)
    assert dm.state_dict() == {"augment_seed": 123}
    torch.manual_seed(7)  # a later reseed (an evaluation inside the run) does not move the stream
    assert dm.state_dict() == {"augment_seed": 123}
    other = DINODataModule(root=root, batch_size=4, augment_on="device", **SMALL_CROPS)
    other.load_state_dict({"augment_seed": 123})
    assert other.augment_seed() == 123
    # A checkpoint from before per-batch seeding holds one generator state: it loads, and is not used.
    old = DINODataModule(root=root, batch_size=4, augment_on="device", **SMALL_CROPS)
    old.load_state_dict({"augment_rng": torch.Generator().manual_seed(5).get_state()})
    assert old.augment_seed() == 7
    assert DINODataModule(root=root, batch_size=4, augment_on="cpu", **SMALL_CROPS).state_dict() == {}


class _FakeTrainer:
    def __init__(self, device: str) -> None:
        self.strategy = type("Strategy", (), {"root_device": torch.device(device)})()
        self.world_size, self.global_rank = 1, 0


@pytest.mark.parametrize("device,want", [("cpu", "cpu"), ("cuda", "device"), ("mps", "device")])
def test_auto_is_device_on_accelerators_and_cpu_on_the_cpu(root, device, want):
    dm = DINODataModule(root=root, batch_size=4, **SMALL_CROPS)
    assert dm.hparams.augment_on == "auto" and dm.augment_on == "cpu"  # before setup: no trainer known
    dm.trainer = _FakeTrainer(device)
    dm.setup("fit")
    assert dm.augment_on == want
    item = dm.train_dataset[0][0]
    if want == "device":  # the worker delivers the decoded image and its crop boxes
        assert item.data.dtype == torch.uint8 and item.boxes.shape == (4, 4)
    else:
        assert item[0].dtype == torch.float32
    assert (dm.device_augment is not None) == (want == "device")
