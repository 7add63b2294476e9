"""A ``CropBatch``'s way to the device: every tensor copied with ``non_blocking=True`` from pinned memory.

Lightning's ``move_data_to_device`` passes ``non_blocking=True`` only to plain tensors and calls ``.to(device)``
on anything else, so the batch type itself must ask for the non-blocking copy. ``meta`` stands in for an
accelerator here: Lightning copies to it non-blocking, as to CUDA (it copies blocking only to CPU and MPS).
"""

from __future__ import annotations

import torch

from ssl_xcit.data.datamodule import DINODataModule
from ssl_xcit.data.device_crops import CropBatch


def host_batch(encoded: bool = False) -> list:
    """``[CropBatch, labels, indices]`` as a worker collates it: 2 decoded images, one encoded when asked."""
    images = torch.randint(0, 256, (2, 3, 20, 24), dtype=torch.uint8)
    files = [torch.randint(0, 256, (100,), dtype=torch.uint8)] if encoded else []
    n = 2 + len(files)
    rois = torch.tensor([[b, 0.0, 0.0, 10.0, 12.0] for _ in range(4) for b in range(n)])
    crops = CropBatch(images, files, [(20, 24)] * n, rois, torch.zeros(4 * n, dtype=torch.bool), len(files))
    return [crops, torch.zeros(n, dtype=torch.int64), torch.arange(n)]


def record_copies(monkeypatch, all_calls: bool = False) -> list[tuple[tuple[int, ...], str, bool]]:
    """``(shape, target device, non_blocking)`` of every ``Tensor.to`` that changes a tensor's device (of every
    call with ``all_calls``)."""
    copies = []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if all_calls or out.device != self.device:
            copies.append((tuple(self.shape), out.device.type, bool(kwargs.get("non_blocking", False))))
        return out

    monkeypatch.setattr(torch.Tensor, "to", to)
    return copies


def test_the_datamodules_transfer_copies_every_tensor_non_blocking(monkeypatch):
    dm = DINODataModule(augment_on="device", global_crops_size=16, local_crops_size=8, local_crops_number=2)
    batch = host_batch(encoded=True)
    copies = record_copies(monkeypatch)
    moved = dm.transfer_batch_to_device(batch, torch.device("meta"), 0)
    crops = batch[0]
    expected = [crops.images.shape, crops.rois.shape, crops.flips.shape, (3,), (3,)]
    assert sorted(copies) == sorted((tuple(s), "meta", True) for s in expected)
    assert moved[0].rois.device.type == "meta" and moved[0].images.device.type == "meta"
    # The file bytes stay on the host, where the batched decoder reads them.
    assert moved[0].encoded[0] is crops.encoded[0]


def test_a_copy_to_the_host_stays_blocking(monkeypatch):
    # A non-blocking device-to-host copy could be read before it has landed.
    crops = host_batch()[0]
    copies = record_copies(monkeypatch, all_calls=True)
    crops.to("cpu")
    crops.to(torch.device("cpu"))
    assert [(device, non_blocking) for _, device, non_blocking in copies] == [("cpu", False)] * 6


def test_pinning_pins_every_tensor_the_transfer_copies(monkeypatch):
    pinned = []

    def pin(self):  # no CUDA here to page-lock with: record what would be
        pinned.append(self)
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    crops = host_batch(encoded=True)[0]
    out = crops.pin_memory()
    assert {id(t) for t in pinned} == {id(crops.images), id(crops.rois), id(crops.flips)}
    assert out.encoded is crops.encoded and out.fallbacks == crops.fallbacks


def test_loaders_pin_on_an_accelerator(monkeypatch, tmp_path):
    from PIL import Image

    for i in range(4):
        (tmp_path / "a").mkdir(exist_ok=True)
        Image.new("RGB", (24, 20), (i, 0, 0)).save(tmp_path / "a" / f"{i}.jpg")
    dm = DINODataModule(
        root=str(tmp_path), val_fraction=0.5, batch_size=1, num_workers=0, augment_on="device",
        global_crops_size=16, local_crops_size=8, local_crops_number=2,
    )  # fmt: skip
    dm.setup("fit")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert dm.train_dataloader().pin_memory and dm.val_dataloader().pin_memory
