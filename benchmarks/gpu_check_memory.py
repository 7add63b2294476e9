"""The memory section of ``gpu_check.py``: ``ssl-xcit plan``'s estimate against the peak measured on the GPU.

One row per configuration, each read as ``ssl-xcit plan -c RECIPE ...`` reads it, at bf16-mixed and batch 64
per GPU: ``recipes/dino_xcit_s12_16.yaml``, the same with activation checkpointing,
``recipes/dino_vit_s16.yaml``, the same with ViT-B/16 (``--model.backbone vit_base_patch16_224``), and that ViT-B/16 under FSDP2 over 8 GPUs.

- plan: ``ssl_xcit.trainer.memory_plan.estimate`` (fake tensors, no GPU): its traced peak under CUDA's
  autocast policy, the same traced with CPU autocast's lists (what the plan traced before issue 52), and its
  peak with the stated overheads (fragmentation, CUDA context and workspaces, NCCL's communicators);
- measured: the same module built on the GPU (``memory_plan.build`` under ``torch.device("cuda")``), AdamW's
  states made, two steady training steps (``memory_plan.training_steps``: the plan's own step functions), in
  this process: ``torch.cuda.max_memory_allocated`` over all of it, less what was allocated before, and
  ``torch.cuda.max_memory_reserved``. FSDP2 runs as one rank of 8 over torch's ``fake`` process group (real
  shards, gathers and reduction buffers on this GPU; no collective moves data), as ``bench_memory_plan.py``
  measures it on a CPU.

A row passes when the plan's traced peak is within ``TOLERANCE`` of the measured peak allocated, and (on a
GPU) the plan's peak with overheads is at least the peak the caching allocator reserved.

``--dry-run``: the same recipes cut to 1 block, out_dim 1024, batch 2, 2 x 32 + 2 x 16 px crops, FSDP2 over 2
fake ranks, measured on the CPU as ``bench_memory_plan.py`` does (the CPU allocator's peak from the profiler).
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
TOLERANCE = 0.15
VIT_B = ["--model.backbone", "vit_base_patch16_224"]
FSDP2_RANKS, DRY_FSDP2_RANKS = 8, 2
# label -> (recipe, overrides, FSDP2 ranks or 0 for DDP on one GPU); every configuration adds COMMON (and DRY)
CONFIGS: dict[str, tuple[str, list[str], int]] = {
    "dino_xcit_s12_16": ("dino_xcit_s12_16.yaml", [], 0),
    "dino_xcit_s12_16 + activation checkpointing": (
        "dino_xcit_s12_16.yaml",
        ["--model.activation_checkpointing", "true"],
        0,
    ),
    "dino_vit_s16": ("dino_vit_s16.yaml", [], 0),
    "dino_vit_s16, ViT-B/16": ("dino_vit_s16.yaml", VIT_B, 0),
    "dino_vit_s16, ViT-B/16, fsdp2": ("dino_vit_s16.yaml", VIT_B, FSDP2_RANKS),
}
COMMON = ["--trainer.precision", "bf16-mixed", "--data.batch_size", "64", "--trainer.devices", "1",
          "--trainer.num_nodes", "1", "--trainer.strategy", "ddp"]  # fmt: skip
DRY = ["--model.backbone_kwargs", "{depth: 1}", "--model.out_dim", "1024", "--model.head_hidden_dim", "256",
       "--model.head_bottleneck_dim", "64", "--data.batch_size", "2", "--data.global_crops_size", "32",
       "--data.local_crops_size", "16", "--data.local_crops_number", "2"]  # fmt: skip


def plan_of(recipe: str, overrides: list[str], ranks: int, dry: bool) -> Any:
    """The ``PlanInput`` that ``ssl-xcit plan -c recipes/RECIPE COMMON OVERRIDES`` makes, under FSDP2 over
    ``ranks`` GPUs when ``ranks`` (the dry run: ``DRY_FSDP2_RANKS``)."""
    from ssl_xcit.cli.plan import apply_overrides, plan_input, read_recipe

    config = read_recipe(str(RECIPES / recipe))
    args = [*COMMON, *(DRY if dry else []), *overrides]
    if ranks:
        args += ["--trainer.strategy", "fsdp2", "--trainer.devices", str(DRY_FSDP2_RANKS if dry else ranks)]
    apply_overrides(config, args)
    return plan_input(config)


@contextlib.contextmanager
def _mesh(plan: Any, device: torch.device) -> Iterator[Any]:
    """A 1-D ``data_parallel`` mesh of ``plan.world_size`` ranks over torch's fake process group (this process
    is rank 0), or None for one rank."""
    if plan.strategy != "fsdp2" or plan.world_size == 1:
        yield None
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    try:
        yield init_device_mesh(device.type, (plan.world_size,), mesh_dim_names=("data_parallel",))
    finally:
        dist.destroy_process_group()


def measure(plan: Any, device: torch.device, bench: Any) -> tuple[int, int | None]:
    """(peak bytes allocated, peak bytes reserved or None on a CPU) of building ``plan``'s module on
    ``device``, its AdamW states and its steady steps."""
    from ssl_xcit.trainer.memory_plan import build, init_optimizer_states, training_steps

    gc.collect()
    with (
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        _mesh(plan, device) as mesh,
    ):
        torch.manual_seed(0)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            with torch.device(device):
                model, optimizer = build(plan, mesh)
            init_optimizer_states(model, optimizer)
            training_steps(model, optimizer, plan, steps=2)
            torch.cuda.synchronize(device)
            measured = (
                torch.cuda.max_memory_allocated(device) - before,
                torch.cuda.max_memory_reserved(device),
            )
            del model, optimizer
            gc.collect()
            torch.cuda.empty_cache()
            return measured
        # measure_here makes its own CPU mesh over the process group _mesh started
        return bench.measure_here(json.dumps(asdict(plan))), None


def planned(check: Any) -> list[Any]:
    gpu_check = sys.modules[type(check).__module__]
    device = torch.device(check.accelerator)

    def make(label: str, recipe: str, overrides: list[str], ranks: int) -> Any:
        from ssl_xcit.trainer.memory_plan import estimate

        plan = plan_of(recipe, overrides, ranks, check.dry)
        setting = _setting(plan)
        est = estimate(plan)
        cpu_lists = estimate(replace(plan, autocast="cpu")).traced_peak
        allocated, reserved = measure(plan, device, gpu_check._load("bench_memory_plan"))
        ratio = est.traced_peak / allocated
        result = (f"plan traced {est.traced_peak / 1e9:.3f} GB, measured peak allocated "
                  f"{allocated / 1e9:.3f} GB (plan / measured {ratio:.3f}; CPU autocast's lists "
                  f"{cpu_lists / 1e9:.3f} GB, {cpu_lists / allocated:.3f})")  # fmt: skip
        ok = abs(ratio - 1) <= TOLERANCE
        if reserved is not None:
            result += f"; plan with overheads {est.peak / 1e9:.2f} GB, peak reserved {reserved / 1e9:.2f} GB"
            ok = ok and est.peak >= reserved
        else:
            result += "; reserved n.a. (CPU)"
        return gpu_check.Row(f"memory {label}", setting, result, "pass" if ok else "fail")

    return [
        gpu_check.Planned(f"memory {label}", f"recipes/{recipe}", lambda a=(label, recipe, o, n): make(*a))
        for label, (recipe, o, n) in CONFIGS.items()
    ]


def _setting(plan: Any) -> str:
    crops = f"2x{plan.global_crops_size}+{plan.local_crops_number}x{plan.local_crops_size} px"
    depth = (plan.model_args.get("backbone_kwargs") or {}).get("depth")
    blocks = f" ({depth} block{'s' if depth != 1 else ''})" if depth else ""
    where = "1 device"
    if plan.strategy == "fsdp2":
        where = f"fsdp2 over {plan.world_size} (fake process group; this device is rank 0)"
    ac = ", activation checkpointing" if plan.model_args.get("activation_checkpointing") else ""
    return (f"{plan.model_args.get('backbone')}{blocks}{ac}, {plan.precision}, batch {plan.batch_size}, "
            f"{crops}, {where}; tolerance {TOLERANCE:.0%}")  # fmt: skip
