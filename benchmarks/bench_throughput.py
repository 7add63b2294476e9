"""Training images/s of the real DINO step, model-bound and through the real loader, and against lightly's DINO.

The step is the module's own: ``DINO.training_step`` under a Lightning Trainer with the module's optimiser
(``configure_optimizers``; ``--fused`` sets its ``fused_optimizer``, torch's fused kernel), the
datamodule's ``on_after_batch_transfer`` (the device augmentation when it is on), ``--precision``,
``--compile`` and ``--ibot`` (``ibot_loss_weight`` 1). Three measurements in one run:

(a) batches in memory: one real multi-crop batch, pinned on CUDA, copied ``non_blocking`` every step; no
    loading happens, so this is the model-bound ceiling;
(b) through the real ``DINODataModule`` loader with ``--workers`` workers, and the loader alone (no model);
(c) the peer, lightly's DINO (``throughput_peer.py``; the ``bench`` extra), on the same device, backbone,
    crops, batch, precision and optimiser; ours (a) / peer is printed (goal >= 1.2x). Without lightly, or
    with ``--ibot`` (lightly has no iBOT), the output says the peer was skipped and why.

Timing: the window spans ``--steps`` steps after ``--warmup``, from one batch start to the batch start
``--steps`` later (so it holds as many loads as steps). On CUDA it is measured with CUDA events and one
``synchronize`` before and one after, none in between, so the CPU/GPU overlap of the real run is kept.
MFU: FLOPs per image are counted with ``FlopCounterMode`` over one uncompiled training step (forwards, losses,
backward), divided by the bf16 dense peak of a recognised GPU (``PEAKS``) or ``--peak-tflops``; on any other
device MFU is ``n/a``, never a guess.

    python benchmarks/bench_throughput.py                       # XCiT-N12/16 at 2x224 + 8x96 on flowers5
    python benchmarks/bench_throughput.py --ci                  # seconds on a CPU: 1 block, 32/16 px crops
    python benchmarks/bench_throughput.py --model xcit_small_12_p16 --batch-size 64 --workers 10 --fused

Data: ``--data`` is an image folder (default ``../shared/data/flowers5``; ``synthetic`` for the built-in set).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import move_data_to_device
from lightning_utilities.core.apply_func import apply_to_collection
from PIL import Image
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from ssl_xcit.cli.quiet import install_filters
from ssl_xcit.data.datamodule import DINODataModule
from ssl_xcit.data.device_crops import CropBatch
from ssl_xcit.data.synthetic import ensure_synthetic_dataset
from ssl_xcit.dino.module import DINO

HERE = Path(__file__).resolve().parent
SHARED = Path(os.environ.get("SSL_XCIT_SHARED_DATA") or HERE.parents[1] / "shared" / "data")
# Dense bf16 tensor-core peaks (NVIDIA data sheets; the sparse figures halved), keyed by the name
# torch.cuda.get_device_name gives. SXM, PCIe and NVL parts of one chip differ; an unknown name gets no peak.
PEAKS: list[tuple[str, float, str]] = [
    (r"\bH100 NVL\b", 835.0, "H100 NVL"),
    (r"\bH100 PCIe\b", 756.0, "H100 PCIe"),
    (r"\bH100 (SXM|80GB HBM3)", 989.0, "H100 SXM"),
    (r"\bH200 NVL\b", 835.0, "H200 NVL"),
    (r"\bH200( SXM)?( 141GB)?( HBM3e)?$", 989.0, "H200 SXM"),
    (r"\bA100\b", 312.0, "A100 (SXM and PCIe)"),
]


def peak_tflops(device_name: str) -> tuple[float | None, str]:
    """(dense bf16 TFLOP/s, model) for a GPU name from ``torch.cuda.get_device_name``; (None, why) if unknown."""
    for pattern, peak, model in PEAKS:
        if re.search(pattern, device_name):
            return peak, model
    return None, f"unknown GPU {device_name!r}: give --peak-tflops"


class Window:
    """Seconds between ``start()`` and ``stop()``: CUDA events with one synchronize before and one after on a
    GPU (nothing in between waits), ``perf_counter`` elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device, self.seconds = device, math.nan

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self._begin = torch.cuda.Event(enable_timing=True)
            self._begin.record()
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            torch.cuda.synchronize(self.device)
            self.seconds = self._begin.elapsed_time(end) / 1000.0
        else:
            self.seconds = time.perf_counter() - self._t0


class WindowTimer(L.Callback):
    """Times the batches ``warmup`` .. ``warmup + steps`` (batch start to batch start); keeps the optimiser."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps, self.seen = warmup, steps, 0
        self.window: Window | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.seen == self.warmup:
            self.window = Window(pl_module.device)
            self.window.start()
        elif self.seen == self.warmup + self.steps:
            self.window.stop()
        self.seen += 1
        self.optimizer = trainer.optimizers[0]

    def rate(self, batch_size: int) -> float:
        if self.window is None or math.isnan(self.window.seconds):
            raise RuntimeError(
                f"only {self.seen} batches ran; the window needs {self.warmup + self.steps + 1}"
            )
        return batch_size * self.steps / self.window.seconds


class FlopCount(L.Callback):
    """FLOPs of the first training step (forwards, losses, backward), counted by ``FlopCounterMode``."""

    def __init__(self) -> None:
        self.counter, self.flops = FlopCounterMode(display=False), None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.flops is None:
            self.counter.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.flops is None:
            self.counter.__exit__(None, None, None)
            self.flops = self.counter.get_total_flops()


class InMemory(L.LightningDataModule):
    """One real training batch replayed every step, copied to the device ``non_blocking`` (pinned on CUDA);
    the real datamodule's device augmentation still runs on it."""

    def __init__(self, data: DINODataModule, batch: Any, steps: int) -> None:
        super().__init__()
        self.data, self.batch, self.steps = data, batch, steps

    def train_dataloader(self) -> DataLoader:
        crops = self.batch[0]
        size = crops.batch_size if isinstance(crops, CropBatch) else crops[0].shape[0]
        return DataLoader(range(size * self.steps), batch_size=size, collate_fn=lambda _: self.batch)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        # CropBatch.to moves the device crops' images and boxes (and keeps file bytes on the host).
        return apply_to_collection(
            batch, (torch.Tensor, CropBatch), lambda t: t.to(device, non_blocking=True)
        )

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return self.data.on_after_batch_transfer(batch, dataloader_idx)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="xcit_nano_12_p16")
    p.add_argument("--depth", type=int, default=None, help="cut the backbone to this many blocks")
    p.add_argument("--out-dim", type=int, default=65536)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--global-size", type=int, default=224)
    p.add_argument("--local-size", type=int, default=96)
    p.add_argument("--local-crops", type=int, default=8)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--steps", type=int, default=6, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--data", default=str(SHARED / "flowers5"), help="image folder, or 'synthetic', or 'ci'")
    p.add_argument("--augment-on", default="auto", choices=["auto", "cpu", "device"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--precision", default=None, help="Lightning precision (default: bf16-mixed on CUDA, else 32)"
    )
    p.add_argument("--fused", action="store_true", help="torch's fused optimiser kernel (ours and the peer)")
    p.add_argument("--compile", action="store_true", help="torch.compile the backbones (ours and the peer)")
    p.add_argument("--ibot", action="store_true", help="iBOT's masked patch term on (ibot_loss_weight 1.0)")
    p.add_argument("--no-peer", action="store_true", help="do not time lightly's DINO")
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads of the training process (0: default)"
    )
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's peak, for MFU")
    p.add_argument("--ci", action="store_true", help="seconds-long smoke run")
    args = p.parse_args(argv)
    if args.ci:
        args.model, args.depth, args.out_dim = "xcit_nano_12_p8", 1, 256
        args.batch_size, args.global_size, args.local_size, args.local_crops = 8, 32, 16, 2
        args.workers, args.steps, args.warmup = 1, 3, 1
        args.data = "ci"
    if args.precision is None:
        args.precision = "bf16-mixed" if args.device.startswith("cuda") else "32-true"
    return args


def ci_images(count: int = 48) -> str:
    """Small photo-like JPEGs in a temporary folder (the CI-size run)."""
    folder = Path(tempfile.mkdtemp(prefix="bench_throughput_"))
    rng = np.random.default_rng(0)
    for i in range(count):
        small = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8))
        small.resize((48, 48), Image.BICUBIC).save(folder / f"{i:03d}.jpg", quality=90)
    return str(folder)


def _peer():
    spec = importlib.util.spec_from_file_location("ssl_xcit_throughput_peer", HERE / "throughput_peer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _probe(data: DINODataModule, device: torch.device) -> Any:
    """Set ``data`` up as a Trainer on ``device`` would (``augment_on=auto`` resolved), without fitting."""
    data.trainer = L.Trainer(accelerator=device.type, devices=1, logger=False)
    data.setup("fit")
    data.trainer = None
    return data


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    install_filters()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    window_batches = args.warmup + args.steps + 1
    if args.data == "ci":
        root = ci_images(max(48, args.batch_size * window_batches))
    else:
        root = str(ensure_synthetic_dataset() / "train") if args.data == "synthetic" else args.data
    data_kw = dict(
        root=root, batch_size=args.batch_size, num_workers=args.workers, persistent_workers=False,
        global_crops_size=args.global_size, local_crops_size=args.local_size, local_crops_number=args.local_crops,
        augment_on=args.augment_on, pin_memory=cuda,
    )  # fmt: skip
    model_kw = dict(
        backbone=args.model, out_dim=args.out_dim, warmup_epochs=0, compile=args.compile,
        collapse_guard="off", backbone_kwargs={"depth": args.depth} if args.depth else None,
        ibot_loss_weight=1.0 if args.ibot else 0.0,
    )  # fmt: skip
    trainer_kw = dict(
        accelerator=device.type, devices=1, max_epochs=1, precision=args.precision, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0,
    )  # fmt: skip

    def build(**override: Any) -> DINO:
        L.seed_everything(0, verbose=False)
        return DINO(**{**model_kw, "fused_optimizer": args.fused, **override})

    def fit(datamodule: L.LightningDataModule, batches: int = window_batches, **override: Any) -> Any:
        timer, flops = WindowTimer(args.warmup, args.steps), FlopCount()
        trainer = L.Trainer(**trainer_kw, limit_train_batches=batches, callbacks=[timer, flops])
        model = build(**override)
        trainer.fit(model, datamodule)
        return timer, flops, model

    # One real batch, from the loader as training sees it (uint8 images and crop boxes in device mode); pinned
    # on CUDA.
    data = _probe(DINODataModule(**{**data_kw, "num_workers": 0}), device)
    where = data.augment_on
    batch = next(iter(data.train_dataloader()))
    if cuda:
        batch = apply_to_collection(batch, (torch.Tensor, CropBatch), lambda t: t.pin_memory())
    timer, _, trained = fit(InMemory(data, batch, window_batches))
    ceiling = timer.rate(args.batch_size)
    opt = timer.optimizer
    _, counted, _ = fit(InMemory(data, batch, 1), batches=1, compile=False)
    flops = counted.flops / args.batch_size

    loader_dm = _probe(DINODataModule(**data_kw), device)
    loader = loader_dm.train_dataloader()
    if len(loader) < window_batches:
        raise SystemExit(
            f"{root} gives {len(loader)} batches of {args.batch_size}; the timing needs --warmup + --steps + 1 = "
            f"{window_batches}: use more images or fewer steps"
        )
    iterator, start = iter(loader), None
    for i in range(window_batches):
        next(iterator)
        if i == args.warmup:
            start = time.perf_counter()
    loader_rate = args.batch_size * args.steps / (time.perf_counter() - start)
    del iterator
    per_worker = loader_rate / max(args.workers, 1)
    through_loader = fit(DINODataModule(**data_kw))[0].rate(args.batch_size)

    if args.peak_tflops:
        peak, peak_source = args.peak_tflops * 1e12, f"--peak-tflops {args.peak_tflops:g}"
    elif cuda:
        name = torch.cuda.get_device_name(device)
        tflops, model_name = peak_tflops(name)
        peak = tflops * 1e12 if tflops else None
        peak_source = f"{model_name}, dense bf16 {tflops:g} TFLOP/s" if tflops else model_name
    else:
        peak, peak_source = None, f"no known peak for {device.type} (give --peak-tflops)"

    def mfu(rate: float) -> str:
        return f"MFU {100 * rate * flops / peak:.1f} %" if peak else "MFU n/a"

    # The peer, on the crops ours trained on (normalised float, as lightly's loader would deliver them).
    peer_module, peer_rate = _peer(), None
    hp = peer_module.bench_lightly_module().ours_hparams(build(), data, 1, window_batches)
    skipped = "--no-peer" if args.no_peer else peer_module.unavailable(hp, args.ibot)
    if skipped is None:
        moved = move_data_to_device(batch, device)
        crops = [c.float().cpu() for c in data.on_after_batch_transfer(moved, 0)[0]]
        if cuda:
            crops = [c.pin_memory() for c in crops]
        peer_rate = peer_module.time_peer(
            build(compile=False), data, crops, device=device, precision=args.precision, fused=args.fused,
            compile=args.compile, warmup=args.warmup, steps=args.steps, window_cls=Window,
        )  # fmt: skip

    fused_on = bool(opt.param_groups[0].get("fused"))
    print(
        f"{args.model}{f' (depth {args.depth})' if args.depth else ''} on {device.type}"
        f"{f' ({torch.cuda.get_device_name(device)})' if cuda else ''}, {torch.get_num_threads()} threads; "
        f"batch {args.batch_size}, 2x{args.global_size} + {args.local_crops}x{args.local_size} crops, "
        f"out_dim {args.out_dim}; augment_on={where}; precision {args.precision}; optimizer "
        f"{type(opt).__name__} (module's, fused {'on' if fused_on else 'off'}); torch.compile "
        f"{'on' if args.compile else 'off'}; iBOT {'on' if args.ibot else 'off'}; "
        f"{args.steps} steps after {args.warmup}, timed with {'CUDA events' if cuda else 'perf_counter'}; "
        f"{os.cpu_count()} CPUs"
    )
    print(f"  FLOPs per image (FlopCounterMode, one step): {flops / 1e9:.3f} GFLOP; peak: {peak_source}")
    print(f"  (a) batches in memory (model-bound ceiling): {ceiling:10.2f} images/s, {mfu(ceiling)}")
    print(
        f"  (b) loader alone, {args.workers} workers:        {loader_rate:10.2f} images/s, "
        f"{per_worker:.2f} images/s per worker"
    )
    print(
        f"  (b) training through the loader:           {through_loader:10.2f} images/s, {mfu(through_loader)}"
    )
    limit = "the data loader (loader-bound)" if loader_rate < ceiling else "the model (model-bound)"
    print(f"  ratio (b) / (a): {through_loader / ceiling:.2f}; loader / ceiling: {loader_rate / ceiling:.2f}")
    print(f"  limited by {limit}; workers per device to reach the ceiling: {math.ceil(ceiling / per_worker)}")
    if peer_rate is None:
        print(f"  (c) peer (lightly DINO): skipped: {skipped}")
    else:
        note = " (ours includes the device augmentation)" if where == "device" else ""
        print(f"  (c) peer (lightly DINO), same crops in memory: {peer_rate:10.2f} images/s")
        print(f"  ours (a) / peer: {ceiling / peer_rate:.2f}x (goal >= 1.2x){note}")
    return {
        "ceiling": ceiling, "loader": loader_rate, "per_worker": per_worker, "through_loader": through_loader,
        "flops_per_image": flops, "peak": peak, "optimizer": opt, "fused": fused_on, "module": trained,
        "peer": peer_rate, "peer_skipped": skipped, "precision": args.precision,
    }  # fmt: skip


if __name__ == "__main__":
    main()
