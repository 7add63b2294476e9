"""What predicts a launch-bound GPU step, measured on a CPU: operators dispatched per DINO training step, and the
host's time per step when no kernel does any work.

    python benchmarks/bench_launches.py                                   # quickstart, XCiT-S12/16, ViT-B/16
    python benchmarks/bench_launches.py --models quickstart --steps 9     # one model, more timed steps
    python benchmarks/bench_launches.py --tiny                            # seconds: a 1-block model (the test)

The step is ``ssl-xcit plan``'s (``ssl_xcit.trainer.memory_plan``): the recipe's own module and AdamW as a fit
sets them up (``foreach``, torch's default for CUDA tensors), then teacher and student forwards over every crop,
losses, backward, centres, clipping, optimiser step, EMA (``DINO.training_step`` and ``window_step`` without a
Trainer: Lightning's own per-step work is not in it). Models: ``recipes/quickstart.yaml`` (its batch and crops),
``recipes/dino_xcit_s12_16.yaml`` (XCiT-S12/16) and ``recipes/dino_vit_s16.yaml`` with ViT-B/16, at 2 x 224 +
8 x 96 px crops.

- operators: a ``TorchDispatchMode`` counts every aten operator of one steady step (after one untimed step),
  autograd's backward included. On the meta device (the module built there: every operator runs its shape
  function only) each is classed as ``kernel`` (an operator on the model's tensors that computes: on a GPU,
  one launch or more; a foreach operator counts once though it launches one kernel per chunk of tensors),
  ``view`` (views, aliases and bare allocations: no kernel) or ``host`` (on host tensors only: AdamW's step
  counters, which torch keeps on the CPU, and their scalar reads). The same count on real CPU tensors (at
  ``--count-batch`` images: the count does not depend on the batch, checked by counting the quickstart at its
  own batch too) differs from the meta count in ``scaled_dot_product_attention`` alone: the CPU runs its
  flash-attention kernels (one forward, one backward, as a GPU does) where the meta device runs its math
  decomposition (softmax, matmuls, views); it also gives bf16-mixed's count under CPU autocast (the casts it
  inserts are kernels too; the meta device has no autocast).
- host time per step, the median over ``--steps`` steps (after ``--warmup``) in process CPU time, one torch
  thread (on a shared machine the wall time also holds the wait for a core). ``host``: the same operator
  sequence with almost nothing to compute: real CPU tensors, batch 1, 2 x 32 + N x 16 px crops, and the model
  cut in width only (``NARROW``: embed_dim 64 for XCiT, 96 for ViT-B/16; head 256 / 64 / 32), so that neither
  activations nor the optimiser's, clipping's and EMA's passes over the weights cost anything: Python,
  autograd, the dispatcher and kernel set-up, what a GPU step costs the host before any launch latency. Its
  operator count is printed beside the full model's: the narrow model runs the same operators (small crops
  change a few, such as a position-embedding interpolation). ``meta``: the full model's step on the meta
  device, where no kernel runs at all; but many meta kernels are torch's Python reference implementations
  (``torch._refs``: a broadcast and a type promotion in Python for each elementwise operator), so it is several
  times ``host``. ``--fake`` adds the step under ``FakeTensorMode`` (fake CPU tensors), which adds its own
  Python per operator. A fake CUDA device (``FakeTensorMode`` with ``device="cuda"``) was tried: its forwards
  run without a GPU, but autograd's backward needs a CUDA context (``hasPrimaryContext``) and
  ``torch.autocast("cuda")`` turns itself off, so it is not used.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
aten = torch.ops.aten
# Operators that launch nothing on a GPU besides views (``OpOverload.is_view``): bare allocations and reshapes
# without a copy.
NO_KERNEL = {aten._unsafe_view.default, aten.empty.memory_format, aten.empty_strided.default,
             aten.empty_like.default, aten.new_empty.default, aten.new_empty_strided.default,
             aten.lift_fresh.default, aten._reshape_alias.default}  # fmt: skip
# name -> (recipe, overrides, as in ``ssl-xcit plan``)
MODELS: dict[str, tuple[str, list[str]]] = {
    "quickstart": ("quickstart.yaml", []),
    "XCiT-S12/16": ("dino_xcit_s12_16.yaml", []),
    "ViT-B/16": ("dino_vit_s16.yaml", ["--model.backbone", "vit_base_patch16_224"]),
}
# The host-time model: the same blocks and heads, cut in width (heads x 8 channels), by backbone.
NARROW = {"xcit_small_12_p16": 64, "xcit_nano_12_p8": 64, "vit_base_patch16_224": 96}
TINY = ["--model.backbone", "xcit_nano_12_p8", "--model.backbone_kwargs", "{depth: 1}", "--model.out_dim", "256",
        "--data.batch_size", "2", "--data.global_crops_size", "32", "--data.local_crops_size", "16",
        "--data.local_crops_number", "2"]  # fmt: skip


class OpCounter(TorchDispatchMode):
    """Every aten operator dispatched while it is on, by operator and by class (``kernel``, ``view``,
    ``host``); ``device`` is the model's device type (on ``cpu`` nothing is classed ``host``)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device
        self.ops: Counter = Counter()
        self.classes: Counter = Counter({"kernel": 0, "view": 0, "host": 0})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops[func] += 1
        self.classes[self.classify(func, args, kwargs)] += 1
        return func(*args, **kwargs)

    def classify(self, func: Any, args: Any, kwargs: dict) -> str:
        if self.device != "cpu":
            devices = {
                t.device.type for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
            }
            if not devices and "device" in kwargs:
                devices = {torch.device(kwargs["device"]).type}
            if devices == {"cpu"} or func is aten._local_scalar_dense.default:
                return "host"
        if func.is_view or func in NO_KERNEL:
            return "view"
        return "kernel"

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def plan_for(name: str, tiny: bool, **changes: Any) -> Any:
    """``ssl-xcit plan -c recipes/RECIPE`` of model ``name`` (its ``PlanInput``), with ``changes``."""
    from ssl_xcit.cli.plan import apply_overrides, plan_input, read_recipe

    recipe, overrides = MODELS[name]
    config = read_recipe(str(REPO / "recipes" / recipe))
    apply_overrides(config, ["--trainer.devices", "1", "--trainer.num_nodes", "1", "--trainer.strategy", "ddp",
                             "--trainer.precision", "32", *overrides, *(TINY if tiny else [])])  # fmt: skip
    return replace(plan_input(config), **changes)


def build(plan: Any, device: str) -> tuple[Any, Any]:
    """The plan's module and optimiser with real CPU tensors, or built on the meta device; AdamW's states made."""
    from ssl_xcit.trainer import memory_plan as mp

    if device == "meta":
        patch = mock.patch.object(torch.nn.init, "trunc_normal_", mp._normal_clamped)  # reads no meta value
        with torch.device("meta"), patch, mp._architecture_only():
            model = mp.model_class(plan.model_class)(**plan.model_args)
        model, optimizer = mp._set_up(model, plan, None)
    else:
        model, optimizer = mp.build(plan)
    mp.init_optimizer_states(model, optimizer)
    return model, optimizer


def step(model: Any, optimizer: Any, plan: Any, crops: list, step_index: int = 0) -> None:
    """``memory_plan.forward_backward`` on ready crops (making them is not the step's), then the update."""
    from ssl_xcit.trainer import memory_plan as mp

    dtype = mp._AUTOCAST.get(plan.precision)
    masks = model.draw_masks(crops[0], [0, 0, step_index, 0]) if model.ibot else None
    with torch.autocast("cpu", dtype=dtype) if dtype else nullcontext():
        out = model.compute_losses(crops, masks, epoch=0, update_center=True)
    out.total.backward()
    mp.update(model, optimizer)


def count(plan: Any, device: str) -> OpCounter:
    """The operators of one steady step (after one step that is not counted)."""
    from ssl_xcit.trainer.memory_plan import make_crops

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model, optimizer = build(plan, device)
        crops, _ = make_crops(plan, device)
        step(model, optimizer, plan, crops)
        with OpCounter(device) as counter:
            step(model, optimizer, plan, crops, 1)
    return counter


def host_seconds(plan: Any, steps: int, warmup: int, where: str = "host") -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each of ``steps`` steps after ``warmup``, 32-true: ``host`` on real CPU tensors at
    batch 1 and 2 x 32 + N x 16 px, ``meta`` on the meta device, ``fake`` under ``FakeTensorMode``. The CPU
    time (this process's, one torch thread) is the figure: on a shared machine the wall time also holds the
    time the process waited for a core."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ssl_xcit.trainer import memory_plan as mp

    plan = replace(plan, precision="32")  # the meta device has no autocast
    mode: Any = nullcontext()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if where == "fake":
            mode = FakeTensorMode()
            model, optimizer = mp.build(plan, None, mode)
            with mode:
                mp.init_optimizer_states(model, optimizer)
                crops, _ = mp.make_crops(plan, "cpu")
        else:
            if where == "host":
                plan = tiny_crops(plan)
            model, optimizer = build(plan, "meta" if where == "meta" else "cpu")
            crops, _ = mp.make_crops(plan, "meta" if where == "meta" else "cpu")
        times = []
        with mode:
            for i in range(warmup + steps):
                wall, cpu = time.perf_counter(), time.process_time()
                step(model, optimizer, plan, crops, i)
                times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return times[warmup:]


def tiny_crops(plan: Any) -> Any:
    """``plan`` at batch 1 and 2 x 32 + N x 16 px crops, cut in width (:data:`NARROW`): kernels with almost
    nothing to compute."""
    args = dict(plan.model_args)
    width = NARROW.get(args.get("backbone", "xcit_small_12_p16"))
    if width:
        args["backbone_kwargs"] = {**(args.get("backbone_kwargs") or {}), "embed_dim": width}
        args.update(out_dim=256, head_hidden_dim=64, head_bottleneck_dim=32)
    return replace(plan, model_args=args, batch_size=1, global_crops_size=32, local_crops_size=16)


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    plan = plan_for(name, args.tiny)
    small = replace(plan, batch_size=min(args.count_batch, plan.batch_size))
    meta = count(replace(plan, precision="32"), "meta")
    real = {p: count(replace(small, precision=p), "cpu") for p in ("32", "bf16-mixed")}
    own_batch = count(replace(plan, precision="32"), "cpu").total if name == "quickstart" else None
    wheres = ("host", "meta", *(("fake",) if args.fake else ()))
    times = {w: host_seconds(plan, args.steps, args.warmup, w) for w in wheres}
    return {
        "model": name, "plan": plan, "meta": meta, "real": real, "own_batch": own_batch,
        "host_ops": count(replace(tiny_crops(plan), precision="32"), "cpu").total,
        **{f"{w}_ms": 1000 * statistics.median(c for _, c in t) for w, t in times.items()},
        "wall_ms": 1000 * statistics.median(w for w, _ in times["host"]),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--steps", type=int, default=5, help="timed meta-device steps (the median is printed)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--count-batch", type=int, default=2, help="images per batch of the real-tensor counts")
    p.add_argument("--fake", action="store_true", help="also time the step under FakeTensorMode")
    p.add_argument("--tiny", action="store_true", help="a 1-block XCiT-N12/8 for every model: seconds")
    args = p.parse_args(argv)
    from ssl_xcit.cli.quiet import install_filters

    install_filters()
    torch.set_num_threads(1)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    print(f"bench_launches {datetime.date.today()}: torch {torch.__version__}, {os.cpu_count()} CPUs, 1 thread; "
          f"one DINO step (memory_plan's), AdamW foreach; times: medians of {args.steps} steps after {args.warmup}"
          f"{' (--tiny)' if args.tiny else ''}")  # fmt: skip
    head = (f"{'model':12s} {'crops':>18s} {'aten ops':>9s} {'kernel':>7s} {'view':>6s} {'host':>5s} "
            f"{'CPU 32':>7s} {'CPU bf16':>8s} {'host ms':>8s} {'(wall)':>8s} {'us/op':>6s} {'meta ms':>8s}")  # fmt: skip
    print(head + (f" {'fake ms':>8s}" if args.fake else ""))
    results = []
    for name in names:
        r = measure(name, args)
        results.append(r)
        plan, meta = r["plan"], r["meta"]
        crops = f"{plan.batch_size} x (2x{plan.global_crops_size}+{plan.local_crops_number}x{plan.local_crops_size})"
        c = meta.classes
        line = (f"{name:12s} {crops:>18s} {meta.total:9d} {c['kernel']:7d} {c['view']:6d} {c['host']:5d} "
                f"{r['real']['32'].total:7d} {r['real']['bf16-mixed'].total:8d} {r['host_ms']:8.1f} "
                f"{r['wall_ms']:8.1f} {1000 * r['host_ms'] / r['host_ops']:6.1f} {r['meta_ms']:8.1f}")  # fmt: skip
        print(line + (f" {r['fake_ms']:8.1f}" if args.fake else ""), flush=True)
    print(f"aten ops = kernel + view + host: one steady step on the meta device, 32-true. CPU 32 / CPU bf16: the "
          f"same step's aten ops on real CPU tensors at batch {args.count_batch} (CPU autocast for bf16-mixed). "
          "host ms: process CPU time of the step on real CPU tensors with almost nothing to compute (batch 1, "
          "2x32 + Nx16 px, the model cut in width), its wall time in brackets, and per aten op; meta ms"
          + (", fake ms" if args.fake else "") + ": the full model's step on the meta device"
          + (" / under FakeTensorMode" if args.fake else "") + ".")  # fmt: skip
    for r in results:
        note = f"{r['model']}: the host-time model runs {r['host_ops']} aten ops"
        if r["own_batch"] is not None:
            note += f"; the full model {r['own_batch']} at its own batch of {r['plan'].batch_size}"
        print(note + f" (the full model at batch {args.count_batch}: {r['real']['32'].total})")
    return results


if __name__ == "__main__":
    main()
