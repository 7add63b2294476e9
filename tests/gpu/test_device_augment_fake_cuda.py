"""The device augmentation on fake CUDA tensors: no device mismatch, no host synchronisation, one copy in.

``FakeTensorMode`` runs the operators by shape on fake ``cuda`` tensors, with no GPU: a CPU tensor meeting a
CUDA one raises ``FakeTensorDeviceMismatchError``, and reading a device value on the host (``.item()``,
``nonzero``, boolean-mask indexing: each a synchronisation on a real GPU) raises. The loader's crops are cut on
the CPU in the DataLoader workers (``ssl_xcit.data.crops``) or on the device from the workers' boxes
(``ssl_xcit.data.device_crops``, whose batch the datamodule's ``transfer_batch_to_device`` moves, inside the
watch), then the photometric half runs, entered through the datamodule's ``on_after_batch_transfer`` as in
training.
"""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ssl_xcit.data.datamodule import DINODataModule
from ssl_xcit.data.device_augment import PhotometricAugment

aten = torch.ops.aten
# Operators that read a device value on the host (FakeTensorMode raises on most; counted here as well).
SYNCING = {aten._local_scalar_dense.default, aten.nonzero.default, aten.is_nonzero.default}


class DeviceTraffic(TorchDispatchMode):
    """Counts host-to-device copies (and those the host waits for: without ``non_blocking``) and host reads of
    device values among the operators it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.to_device: list[tuple[int, ...]] = []
        self.blocking: list[tuple[int, ...]] = []
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCING:
            self.syncs.append(str(func))
        out = func(*args, **kwargs)
        source = args[1] if func is aten.copy_.default else args[0] if args else None
        target = args[0] if func is aten.copy_.default else out
        if (
            func in (aten._to_copy.default, aten.copy_.default)
            and isinstance(source, torch.Tensor)
            and isinstance(target, torch.Tensor)
            and source.device.type == "cpu"
            and target.device.type == "cuda"
        ):
            self.to_device.append(tuple(source.shape))
            if func is aten._to_copy.default:
                non_blocking = kwargs.get("non_blocking", False)
            else:
                non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            if not non_blocking:
                self.blocking.append(tuple(source.shape))
        return out


def fake_batch(batch: int, sizes: list[int]) -> list:
    """[crops, labels, indices] as the loader delivers them, moved to (fake) CUDA."""
    crops = [torch.randint(0, 256, (batch, 3, s, s), dtype=torch.uint8, device="cuda") for s in sizes]
    labels = torch.zeros(batch, dtype=torch.int64, device="cuda")
    return [crops, labels, torch.arange(batch, device="cuda")]


# DINO's 2 x 224 + 8 x 96 at 64 images per GPU, a small run, and local crops of two sizes.
SHAPES = [(64, [224] * 2 + [96] * 8), (4, [32, 32, 16, 16]), (8, [48, 48, 24, 24, 16, 16])]


@pytest.mark.parametrize("batch,sizes", SHAPES)
def test_device_augmentation_on_fake_cuda_copies_once_and_never_syncs(batch, sizes):
    dm = DINODataModule(
        augment_on="device",
        global_crops_size=sizes[0],
        local_crops_size=sizes[-1],
        local_crops_number=len(sizes) - 2,
    )
    traffic = DeviceTraffic()
    # Real CPU tensors the module holds are let in (as fake CPU tensors, so a device mismatch still raises).
    # No default-device context: the code must place every tensor itself, as in training.
    with FakeTensorMode(allow_non_fake_inputs=True):
        data = fake_batch(batch, sizes)
        with traffic:
            out = dm.on_after_batch_transfer(data, 0)
    assert [tuple(c.shape) for c in out[0]] == [tuple(c.shape) for c in data[0]]
    assert all(isinstance(c, FakeTensor) and c.device.type == "cuda" for c in out[0])
    assert all(c.dtype == torch.float32 for c in out[0])
    # One copy of one flat buffer: parameters, indices, kernels and the normalisation constants together.
    assert traffic.syncs == [] and traffic.blocking == []
    assert len(traffic.to_device) == 1 and len(traffic.to_device[0]) == 1


def test_every_operation_runs_on_fake_cuda():
    # Every probability 1 and every jitter strength on: each kernel (all 4 jitter ops, grayscale, blur,
    # solarise) is launched on every crop.
    augment = PhotometricAugment(
        color_jitter_prob=1.0, grayscale_prob=1.0, global_blur_probs=(1.0, 1.0), local_blur_prob=1.0,
        global_solarize_probs=(1.0, 1.0), local_solarize_prob=1.0,
    )  # fmt: skip
    plan = augment.plan([(4, 3, 32, 32)] * 2 + [(4, 3, 16, 16)] * 2, np.random.default_rng(0))
    for g in plan.groups:
        assert {op for op, _, _ in g.jitter} == {0, 1, 2, 3} and g.grayscale and g.blur and g.solarize
        assert sum(rows[1] - rows[0] for _, rows, _ in g.jitter) == 4 * 8  # 4 ops on each of the 8 crops
    traffic = DeviceTraffic()
    with FakeTensorMode(), torch.device("cuda"), traffic:
        crops = [torch.zeros(4, 3, s, s, dtype=torch.uint8) for s in (32, 32, 16, 16)]
        out = augment.run(crops, plan)
    assert [c.device.type for c in out] == ["cuda"] * 4
    assert traffic.syncs == [] and traffic.blocking == [] and len(traffic.to_device) == 1


@pytest.mark.parametrize("precision,dtype", [("bf16-true", torch.bfloat16), ("16-true", torch.float16)])
def test_hook_returns_the_precision_plugins_dtype_on_fake_cuda(precision, dtype):
    dm = DINODataModule(augment_on="device", global_crops_size=32, local_crops_size=16, local_crops_number=2)
    dm.trainer = L.Trainer(accelerator="cpu", precision=precision, logger=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = dm.on_after_batch_transfer(fake_batch(4, [32, 32, 16, 16]), 0)
    assert [c.dtype for c in out[0]] == [dtype] * 4 and out[1].dtype == torch.int64


def test_the_parameter_copy_is_pinned_where_cuda_is_real(monkeypatch):
    # No GPU here: pretend CUDA is available and record the tensors pinned (FakeTensorMode cannot pin).
    pinned = []

    def pin(self):
        pinned.append(tuple(self.shape))
        return self

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    augment = PhotometricAugment()
    plan = augment.plan([(4, 3, 16, 16)] * 2, np.random.default_rng(0))
    with FakeTensorMode(), torch.device("cuda"):
        augment.run([torch.zeros(4, 3, 16, 16, dtype=torch.uint8)] * 2, plan)
    assert pinned == [plan.buffer.shape]


@pytest.mark.parametrize("batch,sizes", SHAPES[:2])  # the datamodule has one local crop size
def test_device_crops_then_augmentation_on_fake_cuda_never_sync(batch, sizes):
    # The worker's batch (padded uint8 images, roi rows, flips) moved to (fake) CUDA by the datamodule's
    # transfer (Lightning's move_data_to_device, which calls CropBatch.to): every copy non-blocking; the crops
    # are then cut and augmented there with one parameter copy and no host read.
    dm = DINODataModule(
        augment_on="device",
        global_crops_size=sizes[0],
        local_crops_size=sizes[-1],
        local_crops_number=len(sizes) - 2,
    )
    host, out, traffic = _transfer_on_fake_cuda(dm, batch, len(sizes))
    assert [tuple(c.shape) for c in out[0]] == [(batch, 3, s, s) for s in sizes]
    assert all(isinstance(c, FakeTensor) and c.device.type == "cuda" for c in out[0])
    assert out[1].device.type == "cuda" and out[2].device.type == "cuda"
    batch_tensors = [host.images.shape, host.rois.shape, host.flips.shape, (batch,), (batch,)]
    assert sorted(traffic.to_device[:5]) == sorted(tuple(s) for s in batch_tensors)
    assert len(traffic.to_device) == 6 and len(traffic.to_device[5]) == 1  # then the one parameter buffer
    assert traffic.syncs == [] and traffic.blocking == []


def _transfer_on_fake_cuda(dm: DINODataModule, batch: int, crops: int):
    """A host CropBatch of ``batch`` padded images with ``crops`` boxes each, moved to a fake CUDA device and
    augmented there by ``dm``'s hooks under a traffic recorder: (host batch, output, traffic)."""
    from ssl_xcit.data.device_crops import CropBatch

    rng = np.random.default_rng(0)
    x1, y1 = rng.uniform(0, 100, (2, crops * batch))
    boxes = np.stack([np.tile(np.arange(batch), crops), x1, y1, x1 + 80, y1 + 60], 1)
    host = CropBatch(
        torch.zeros(batch, 3, 200, 250, dtype=torch.uint8),
        [],
        [(200, 250)] * batch,
        torch.from_numpy(boxes.astype(np.float32)),
        torch.from_numpy(rng.random(crops * batch) < 0.5),
        0,
    )
    data = [host, torch.zeros(batch, dtype=torch.int64), torch.arange(batch)]
    traffic = DeviceTraffic()
    with FakeTensorMode(allow_non_fake_inputs=True), traffic:
        out = dm.on_after_batch_transfer(dm.transfer_batch_to_device(data, torch.device("cuda"), 0), 0)
    return host, out, traffic


def test_gram_crops_are_cut_and_normalised_on_fake_cuda_without_a_sync():
    # Gram anchoring on: the datamodule cuts 2 more crops (the global boxes at twice the side) from the same
    # padded images, and normalises them with the constants of the one parameter copy.
    batch, sizes = 4, [32, 32, 16, 16, 64, 64]
    dm = DINODataModule(augment_on="device", global_crops_size=32, local_crops_size=16, local_crops_number=2)
    dm.use_gram_crops(2)
    host, out, traffic = _transfer_on_fake_cuda(dm, batch, len(sizes))
    crops, gram = out[0]["crops"], out[0]["gram_crops"]
    assert [tuple(c.shape) for c in crops] == [(batch, 3, s, s) for s in sizes[:4]]
    assert [tuple(c.shape) for c in gram] == [(batch, 3, 64, 64)] * 2
    assert all(isinstance(c, FakeTensor) and c.device.type == "cuda" for c in crops + gram)
    assert all(c.dtype == torch.float32 for c in crops + gram)
    assert len(traffic.to_device) == 6 and len(traffic.to_device[5]) == 1  # the batch, then one buffer
    assert traffic.syncs == [] and traffic.blocking == []
