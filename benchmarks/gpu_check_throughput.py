"""The throughput section of ``gpu_check.py``: images/s and MFU of the DINO training step, compile off and on.

One row per (model, batch, compile): XCiT-S12/16 and ViT-B/16 at batch 32 and 64 per GPU, 2 x 224 + 8 x 96 px
crops, out_dim 65536, bf16-mixed, the module's AdamW with torch's fused kernel, under a Lightning Trainer (the
module's own ``training_step``: teacher and student forwards, losses, backward, clipping, optimiser step,
EMA). One multi-crop batch, made once on the device, is replayed every step (no loading: the model-bound
rate). Every compile-off row runs before any compile-on row (compiling is the long part: a budget that ends
stops those first).

- first step: seconds from the first batch's start to the second's (device synchronised at both), which
  holds torch.compile's compilation when it is on;
- images/s: ``STEPS`` steps after ``WARMUP``, from one batch start to the batch start ``STEPS`` later,
  synchronised at both ends only;
- MFU: images/s x FLOPs per image / the GPU's dense bf16 peak (``bench_throughput.PEAKS``: H100 SXM and H200
  989 TFLOP/s, A100 312); ``n.a.`` for any other device. FLOPs per image: ``FlopCounterMode`` over the second
  step of the compile-off run (student forward and backward, teacher forward, losses), divided by the batch;
  the compile-on row uses the count of its compile-off row (the same arithmetic).

``--dry-run``: a 1-block model, batch 2 and 4, 32 / 16 px crops, out_dim 256, 32-true on the CPU, and
``aot_eager`` for compile (inductor's C++ compilation takes minutes on a shared CPU; the compile path, its
graphs and the timing still run); the figures are a CPU's, printed, meaningless for a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

MODELS = {"XCiT-S12/16": "xcit_small_12_p16", "ViT-B/16": "vit_base_patch16_224"}
WARMUP, STEPS = 3, 5  # batch 0: the first step; batch 1: FLOPs counted; batch 2: warm; then STEPS timed
GPU = {"batches": (32, 64), "sizes": (224, 96, 8), "out_dim": 65536, "precision": "bf16-mixed", "depth": None}
DRY = {"batches": (2, 4), "sizes": (32, 16, 2), "out_dim": 256, "precision": "32-true", "depth": 1}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(device: torch.device, flops_at: int | None) -> Any:
    import lightning as L
    from torch.utils.flop_counter import FlopCounterMode

    class StepClock(L.Callback):
        """Batch-start times of batches 0, 1, ``WARMUP`` and ``WARMUP + STEPS`` (synchronised there only),
        and the FLOPs of batch ``flops_at``'s step."""

        def __init__(self) -> None:
            self.marks: dict[int, float] = {}
            self.counter, self.flops = FlopCounterMode(display=False), None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx in (0, 1, WARMUP, WARMUP + STEPS):
                _sync(device)
                self.marks[batch_idx] = time.perf_counter()
            if batch_idx == flops_at:
                self.counter.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == flops_at:
                self.counter.__exit__(None, None, None)
                self.flops = self.counter.get_total_flops()

    return StepClock()


@contextlib.contextmanager
def _aot_eager(on: bool) -> Iterator[None]:
    """torch.compile with ``backend="aot_eager"`` while the block runs (the dry run's compile)."""
    if not on:
        yield
        return
    compile_fn = torch.compile
    torch.compile = lambda fn=None, **kw: compile_fn(fn, **{**kw, "backend": "aot_eager"})
    try:
        yield
    finally:
        torch.compile = compile_fn


def measure(
    dry: bool, accelerator: str, backbone: str, batch: int, compile_: bool, count_flops: bool
) -> dict:
    """One configuration's first-step seconds, images/s and (``count_flops``) FLOPs per image."""
    import lightning as L
    from torch.utils.data import DataLoader

    from ssl_xcit.data.datasets import collate_train
    from ssl_xcit.dino.module import DINO

    cfg = DRY if dry else GPU
    global_size, local_size, locals_ = cfg["sizes"]
    device = torch.device(accelerator)
    g = torch.Generator().manual_seed(0)
    sizes = (global_size, global_size) + (local_size,) * locals_
    items = [([torch.randn(3, s, s, generator=g) for s in sizes], 0, i) for i in range(batch)]
    data = collate_train(items)
    data = [[c.to(device) for c in data[0]], *data[1:]]
    batches = WARMUP + STEPS + 1
    loader = DataLoader(range(batch * batches), batch_size=batch, collate_fn=lambda _: data)
    clock = _clock(device, 1 if count_flops else None)
    L.seed_everything(0, verbose=False)
    model = DINO(backbone=backbone, out_dim=cfg["out_dim"], warmup_epochs=0, compile=compile_,
                 collapse_guard="off", fused_optimizer=device.type == "cuda",
                 backbone_kwargs={"depth": cfg["depth"]} if cfg["depth"] else None)  # fmt: skip
    trainer = L.Trainer(accelerator=accelerator, devices=1, precision=cfg["precision"], max_epochs=1,
                        limit_train_batches=batches, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[clock])  # fmt: skip
    with _aot_eager(dry and compile_):
        trainer.fit(model, loader)
    marks = clock.marks
    if trainer.global_step != batches or WARMUP + STEPS not in marks:
        raise RuntimeError(f"{trainer.global_step} of {batches} steps ran")
    return {
        "first_step": marks[1] - marks[0],
        "rate": batch * STEPS / (marks[WARMUP + STEPS] - marks[WARMUP]),
        "flops": clock.flops / batch if clock.flops else None,
    }


def peak_flops(check: Any) -> tuple[float | None, str]:
    """(dense bf16 FLOP/s, what it is) of the check's GPU; (None, why) elsewhere."""
    if check.dry:
        return None, "a CPU: no peak"
    bench = sys.modules[type(check).__module__]._load("bench_throughput")
    tflops, model = bench.peak_tflops(torch.cuda.get_device_name(0))
    return (tflops * 1e12, f"{model} {tflops:g} TFLOP/s") if tflops else (None, model)


def planned(check: Any) -> list[Any]:
    gpu_check = sys.modules[type(check).__module__]
    cfg = DRY if check.dry else GPU
    global_size, local_size, locals_ = cfg["sizes"]
    flops: dict[tuple[str, int], float] = {}  # (backbone, batch) -> FLOPs per image, from the compile-off row
    peak: list[tuple[float | None, str]] = []

    def make(label: str, backbone: str, batch: int, compile_: bool, setting: str) -> Any:
        if not peak:
            peak.append(peak_flops(check))
        top, source = peak[0]
        out = measure(check.dry, check.accelerator, backbone, batch, compile_, count_flops=not compile_)
        if out["flops"]:
            flops[(backbone, batch)] = out["flops"]
        per_image = flops.get((backbone, batch))
        if per_image and top:
            mfu = f"MFU {100 * out['rate'] * per_image / top:.1f} % of {source}"
        else:
            mfu = (
                "MFU n.a. ("
                + ("no FLOP count: its compile-off row did not run" if not per_image else source)
                + ")"
            )
        gflop = f"{per_image / 1e9:.2f} GFLOP/image" if per_image else "FLOPs not counted"
        result = f"{out['rate']:.1f} images/s, {mfu}, first step {out['first_step']:.1f} s, {gflop}"
        ok = math.isfinite(out["rate"]) and out["rate"] > 0 and (compile_ or bool(per_image))
        return gpu_check.Row(f"throughput {label}", setting, result, "pass" if ok else "fail")

    rows = []
    for compile_ in (False, True):
        for label, backbone in MODELS.items():
            for batch in cfg["batches"]:
                depth = f" ({cfg['depth']} block)" if cfg["depth"] else ""
                how = ("on (aot_eager)" if check.dry else "on") if compile_ else "off"
                setting = (f"batch {batch}, compile {how}, {cfg['precision']}, 2x{global_size}+{locals_}x{local_size} "
                           f"px, out_dim {cfg['out_dim']}{depth}, {STEPS} steps after {WARMUP}")  # fmt: skip
                make_row = functools.partial(make, label, backbone, batch, compile_, setting)
                rows.append(gpu_check.Planned(f"throughput {label}", setting, make_row))
    return rows
