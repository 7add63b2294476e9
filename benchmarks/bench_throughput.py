"""Training images/s of the real DINO step, model-bound and through the real loader: which one limits a run.

Two measurements of the same Lightning training step (``DINO.training_step`` with the datamodule's
``on_after_batch_transfer``, so the device augmentation is included when it is on), in one run:

(a) batches already in memory: one real multi-crop batch is replayed every step, so no loading happens; this
    is the model-bound ceiling;
(b) through the real ``DINODataModule`` loader with ``--workers`` workers; plus the loader alone (no model), for
    the per-worker rate.

It then prints which of the two limits the run, the workers per device needed to reach the ceiling, and the
MFU: FLOPs per image are counted with ``torch.utils.flop_counter.FlopCounterMode`` over one step's teacher and
student forwards, loss and backward (not by hand), divided by the device's peak (``--peak-tflops``, or the bf16
dense peak of a recognised GPU). On CUDA the step uses bf16 autocast and fused AdamW, and ``--compile``
``torch.compile``s the backbones; the output says which were on.

    python benchmarks/bench_throughput.py                       # XCiT-N12/16 at 2x224 + 8x96 on flowers5
    python benchmarks/bench_throughput.py --ci                  # seconds: a 1-block model, 32/16 px crops
    python benchmarks/bench_throughput.py --device cuda --model xcit_small_12_p16 --batch-size 64 --workers 10

Data: ``--data`` is an image folder (default ``../shared/data/flowers5``; ``synthetic`` for the built-in set).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from ssl_xcit.cli.quiet import install_filters
from ssl_xcit.data.datamodule import DINODataModule
from ssl_xcit.data.synthetic import ensure_synthetic_dataset
from ssl_xcit.dino.module import DINO
from ssl_xcit.dino.optim import get_params_groups

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SSL_XCIT_SHARED_DATA") or REPO_ROOT.parent / "shared" / "data")
# Dense bf16 tensor-core peaks (vendor data sheets): A100 312 TFLOP/s; H100 and H200 SXM 989 TFLOP/s.
PEAK_BF16 = {"A100": 312e12, "H100": 989e12, "H200": 989e12}


class BenchDINO(DINO):
    """DINO with fused AdamW on CUDA (one kernel for all parameters); the reference's AdamW otherwise."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        fused = self.device.type == "cuda"
        return torch.optim.AdamW(get_params_groups(self.student), lr=0.0, fused=fused or None)


class StepTimer(L.Callback):
    """Wall time between consecutive batch starts (loading included), after ``warmup`` steps."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.starts = warmup, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        self.on_train_batch_start(trainer, pl_module, None, -1)

    def step_seconds(self) -> list[float]:
        times = self.starts[self.warmup :]
        return [b - a for a, b in zip(times, times[1:], strict=False)]


class InMemory(L.LightningDataModule):
    """One real training batch replayed every step; the real datamodule's device augmentation still runs."""

    def __init__(self, data: DINODataModule, batch: Any, steps: int) -> None:
        super().__init__()
        self.data, self.batch, self.steps = data, batch, steps

    def train_dataloader(self) -> DataLoader:
        size = self.batch[0][0].shape[0]
        return DataLoader(range(size * self.steps), batch_size=size, collate_fn=lambda _: self.batch)

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
    p.add_argument("--compile", action="store_true", help="torch.compile the backbones (CUDA)")
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
    return args


def ci_images(count: int = 48) -> str:
    """Small photo-like JPEGs in a temporary folder (the CI-size run)."""
    folder = Path(tempfile.mkdtemp(prefix="bench_throughput_"))
    rng = np.random.default_rng(0)
    for i in range(count):
        small = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8))
        small.resize((48, 48), Image.BICUBIC).save(folder / f"{i:03d}.jpg", quality=90)
    return str(folder)


def flops_per_image(model: DINO, crops: list[torch.Tensor], amp: bool) -> float:
    """FLOPs of one DINO step's forwards (teacher on the global crops, student on all), loss and backward."""
    model.train()
    with FlopCounterMode(display=False) as counter:
        with torch.autocast(crops[0].device.type, dtype=torch.bfloat16, enabled=amp):
            with torch.no_grad():
                teacher = model.teacher(crops[:2])
            loss = model.dino_loss(model.student(crops), teacher, 0, update_center=False).loss
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / crops[0].shape[0]


def peak_flops(args: argparse.Namespace, device: torch.device) -> tuple[float | None, str]:
    if args.peak_tflops:
        return args.peak_tflops * 1e12, f"--peak-tflops {args.peak_tflops:g}"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in PEAK_BF16.items():
            if key in name:
                return peak, f"{name}, dense bf16 {peak / 1e12:g} TFLOP/s"
    return None, "unknown peak (give --peak-tflops)"


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    install_filters()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.data == "ci":
        root = ci_images()
    else:
        root = str(ensure_synthetic_dataset() / "train") if args.data == "synthetic" else args.data
    data_kw = dict(
        root=root, batch_size=args.batch_size, num_workers=args.workers, persistent_workers=False,
        global_crops_size=args.global_size, local_crops_size=args.local_size, local_crops_number=args.local_crops,
        augment_on=args.augment_on,
    )  # fmt: skip
    model_kw = dict(
        backbone=args.model, out_dim=args.out_dim, warmup_epochs=0, compile=args.compile and cuda,
        collapse_guard="off", backbone_kwargs={"depth": args.depth} if args.depth else None,
    )  # fmt: skip
    trainer_kw = dict(
        accelerator=device.type, devices=1, max_epochs=1, limit_train_batches=args.warmup + args.steps + 1,
        precision="bf16-mixed" if cuda else "32-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip

    def fit(datamodule: L.LightningDataModule) -> float:
        L.seed_everything(0, verbose=False)
        timer = StepTimer(args.warmup)
        trainer = L.Trainer(**trainer_kw, callbacks=[timer])
        trainer.fit(BenchDINO(**model_kw), datamodule)
        return args.batch_size / statistics.median(timer.step_seconds())

    # One real batch, from the loader as training sees it (uint8 crops in device mode).
    data = DINODataModule(**{**data_kw, "num_workers": 0})
    probe = L.Trainer(accelerator=device.type, devices=1, logger=False)
    data.trainer = probe
    data.setup("fit")
    where = data.augment_on
    batch = next(iter(data.train_dataloader()))
    data.trainer = None
    ceiling = fit(InMemory(data, batch, args.warmup + args.steps + 1))

    loader_dm = DINODataModule(**data_kw)
    loader_dm.trainer = probe
    loader_dm.setup("fit")
    loader_dm.trainer = None
    iterator, start = iter(loader_dm.train_dataloader()), None
    for i in range(args.warmup + args.steps + 1):
        next(iterator)
        if i == args.warmup:
            start = time.perf_counter()
    loader_rate = args.batch_size * args.steps / (time.perf_counter() - start)
    del iterator
    per_worker = loader_rate / max(args.workers, 1)
    through_loader = fit(DINODataModule(**data_kw))

    model = BenchDINO(**{**model_kw, "compile": False}).to(device)
    moved = [c.to(device) for c in batch[0]]
    crops = data.on_after_batch_transfer([moved, *batch[1:]], 0)[0]
    flops = flops_per_image(model, crops, amp=cuda)
    peak, peak_source = peak_flops(args, device)

    def mfu(rate: float) -> str:
        return f"MFU {100 * rate * flops / peak:.1f} %" if peak else "MFU n/a"

    print(
        f"{args.model}{f' (depth {args.depth})' if args.depth else ''} on {device.type}"
        f"{f' ({torch.cuda.get_device_name(device)})' if cuda else ''}, {torch.get_num_threads()} threads; "
        f"batch {args.batch_size}, 2x{args.global_size} + {args.local_crops}x{args.local_size} crops, "
        f"out_dim {args.out_dim}; augment_on={where}; bf16 autocast {'on' if cuda else 'off'}, fused AdamW "
        f"{'on' if cuda else 'off'}, torch.compile {'on' if args.compile and cuda else 'off'}; "
        f"median of {args.steps} steps after {args.warmup}; {os.cpu_count()} CPUs"
    )
    print(
        f"  FLOPs per image (FlopCounterMode, forward + backward): {flops / 1e9:.2f} GFLOP; peak: {peak_source}"
    )
    print(f"  (a) batches in memory (model-bound ceiling): {ceiling:8.2f} images/s, {mfu(ceiling)}")
    print(
        f"  (b) loader alone, {args.workers} workers:        {loader_rate:8.2f} images/s, "
        f"{per_worker:.2f} images/s per worker"
    )
    print(
        f"  (b) training through the loader:           {through_loader:8.2f} images/s, {mfu(through_loader)}"
    )
    limit = "the data loader" if loader_rate < ceiling else "the model"
    print(f"  ratio (b) / (a): {through_loader / ceiling:.2f}; loader / ceiling: {loader_rate / ceiling:.2f}")
    print(f"  limited by {limit}; workers per device to reach the ceiling: {math.ceil(ceiling / per_worker)}")
    return {
        "ceiling": ceiling,
        "loader": loader_rate,
        "per_worker": per_worker,
        "through_loader": through_loader,
        "flops_per_image": flops,
    }


if __name__ == "__main__":
    main()
