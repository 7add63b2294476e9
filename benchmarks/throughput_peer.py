"""The peer's step for ``bench_throughput.py``: lightly's DINO, as ``bench_lightly.py`` builds it, timed on the
same device, backbone, crops, batch, precision and optimiser as ours.

The loop follows lightly's documented DINO example: the teacher on the 2 global views and the student on every
view, one forward per view; lightly's ``DINOLoss``; ``cancel_last_layer_gradients``; the optimiser step;
``update_momentum``. What is shared with ours on purpose (so the ratio measures the step, not the settings):
the backbone and start weights, the optimiser built by ``build_optimizer`` with our parameter groups (fused
when ours is), our per-parameter gradient clipping, ``torch.compile`` of the backbones when ours has it, and
the replayed crops (pinned, copied ``non_blocking`` every step, as ours). Lightly has no device augmentation:
its crops arrive augmented from its loader workers, so its timed step has none.
"""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path
from typing import Any

import torch

from ssl_xcit.dino.optim import build_optimizer, clip_gradients, get_params_groups

HERE = Path(__file__).resolve().parent


def bench_lightly_module():
    """benchmarks/bench_lightly.py as a module (the benchmarks folder is not a package)."""
    spec = importlib.util.spec_from_file_location("ssl_xcit_bench_lightly", HERE / "bench_lightly.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def unavailable(hp: dict[str, Any], ibot: bool) -> str | None:
    """Why the peer cannot be timed at these settings (None: it can)."""
    try:
        import lightly  # noqa: F401
    except ImportError as err:
        return f"lightly is not installed ({err}; pip install -e '.[bench]')"
    if ibot:
        return "lightly's DINO has no iBOT term, so its step would do less work than ours"
    try:
        bench_lightly_module().check_lightly_can(hp)
    except ValueError as err:
        return str(err)
    return None


def time_peer(
    model: Any, datamodule: Any, crops: list[torch.Tensor], *, device: torch.device, precision: str,
    fused: bool, compile: bool, warmup: int, steps: int, window_cls: Any,
) -> float:  # fmt: skip
    """Images/s of lightly's DINO step over ``steps`` steps after ``warmup``, on the replayed ``crops`` (CPU
    tensors, pinned by the caller on CUDA), built from ``model`` (our DINO: settings and start weights)."""
    bench = bench_lightly_module()
    from lightly.models.utils import update_momentum

    hp = bench.ours_hparams(model, datamodule, epochs=1, steps_per_epoch=warmup + steps)
    student, teacher, loss_fn = bench.build_lightly(hp, model.student)
    dtype = {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision)
    for net in (student, teacher, loss_fn):
        net.to(device=device)
        if dtype is not None:
            net.to(dtype=dtype)
    if compile:
        student.backbone.compile()
        teacher.backbone.compile()
    opt = build_optimizer(model.hparams.optimizer, get_params_groups(student), fused=fused)
    for group in opt.param_groups:  # a constant schedule value: setting it per step costs the same as ours
        group["lr"] = model.hparams.lr
    amp = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
    student.train()
    teacher.train()
    momentum = hp["momentum_teacher"]

    def step() -> None:
        views = [c.to(device, non_blocking=True) for c in crops]
        if dtype is not None:
            views = [v.to(dtype) for v in views]
        autocast = torch.autocast(device.type, dtype=amp) if amp else contextlib.nullcontext()
        with autocast:
            with torch.no_grad():
                teacher_out = [teacher(v) for v in views[:2]]
            student_out = [student(v) for v in views]
            loss = loss_fn(teacher_out, student_out, epoch=0)
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        if hp["clip_grad"]:
            clip_gradients(student, hp["clip_grad"])
        student.head.cancel_last_layer_gradients(current_epoch=0)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        update_momentum(student, teacher, m=momentum)

    for _ in range(warmup):
        step()
    window = window_cls(device)
    window.start()
    for _ in range(steps):
        step()
    window.stop()
    return crops[0].shape[0] * steps / window.seconds
