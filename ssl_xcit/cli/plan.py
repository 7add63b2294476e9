"""``ssl-xcit plan``: the peak memory per GPU of a DINO run's training step, estimated without a GPU.

    ssl-xcit plan --model.backbone vit_large_patch16_224 --trainer.precision bf16-mixed --trainer.devices 8
    ssl-xcit plan -c recipes/dino_xcit_s12_16.yaml --trainer.strategy fsdp2 --trainer.devices 8 --max-batch
    ssl-xcit plan --table xcit_small_12_p16,vit_large_patch16_224 --trainer.devices 8   # the docs' table

It reads a run as ``ssl-xcit fit`` does: a recipe (``-c``) and ``--model.*``, ``--data.*`` and ``--trainer.*``
overrides in the same form (``--model.init_args.X`` or ``--model.X``). What it uses: the model's class and
arguments, the data's ``batch_size`` (per GPU), ``global_crops_size``, ``local_crops_number`` and
``local_crops_size``, the trainer's ``precision``, ``strategy`` and ``devices`` x ``num_nodes`` (GPUs in all);
every other key is read and ignored. Without a recipe: DINO's and the datamodule's defaults (XCiT-S12/16,
batch 64, 2 x 224 + 8 x 96 crops), ``bf16-mixed``, DDP on one GPU. ``ssl_xcit.trainer.memory_plan`` says how
the estimate is made and what it adds to the trace.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from ssl_xcit.errors import UserError

DATA_KEYS = ("batch_size", "global_crops_size", "local_crops_number", "local_crops_size")
STRATEGY_NAMES = {"auto": "ddp", "ddp": "ddp", "ddp_spawn": "ddp", "single_device": "ddp", "fsdp2": "fsdp2"}
STRATEGY_NAMES["fsdp2_whole"] = "fsdp2"
PRECISION_NAMES = {"32": "32", "32-true": "32", "bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed"}
TABLE_COLUMNS = (("ddp", False), ("ddp", True), ("fsdp2", False), ("fsdp2", True))


def _section(config: dict[str, Any], name: str) -> dict[str, Any]:
    section = config.get(name) or {}
    if not isinstance(section, dict):
        raise UserError(f"the recipe's {name!r} must be a mapping, got {section!r}")
    return section


def read_recipe(path: str | None) -> dict[str, dict[str, Any]]:
    """``{"model": {class_path, init_args}, "data": init_args, "trainer": {...}}`` of a recipe (or empty)."""
    config: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise UserError(f"recipe {path!r} does not exist")
        config = yaml.safe_load(Path(path).read_text()) or {}
    model, data = _section(config, "model"), _section(config, "data")
    return {
        "model": {"class_path": model.get("class_path"), "init_args": dict(model.get("init_args") or {})},
        "data": dict(data.get("init_args") or {}),
        "trainer": dict(_section(config, "trainer")),
    }


def apply_overrides(recipe: dict[str, dict[str, Any]], overrides: Sequence[str]) -> None:
    """``--model.X V``, ``--model.init_args.X V``, ``--data[.init_args].X V``, ``--trainer.X V`` (or
    ``--key=V``); values are read as YAML, as the fit command's parser reads them."""
    items = list(overrides)
    while items:
        token = items.pop(0)
        key, eq, value = token.partition("=")
        if not eq:
            if not items:
                raise UserError(f"{token} needs a value")
            value = items.pop(0)
        section, _, name = key.removeprefix("--").partition(".")
        if not key.startswith("--") or section not in ("model", "data", "trainer") or not name:
            raise UserError(
                f"unknown option {key!r}; ssl-xcit plan takes -c RECIPE, --model.KEY, --data.KEY, --trainer.KEY, "
                "--gpu-memory, --max-batch and --table (ssl-xcit plan --help)"
            )
        parsed = yaml.safe_load(value) if value != "" else value
        if section == "model" and name == "class_path":
            recipe["model"]["class_path"] = parsed
        elif section == "model":
            recipe["model"]["init_args"][name.removeprefix("init_args.")] = parsed
        elif section == "data":
            recipe["data"][name.removeprefix("init_args.")] = parsed
        else:
            recipe["trainer"][name] = parsed


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{what} must be an integer >= 1 for a plan, got {value!r}")
    return value


def plan_input(recipe: dict[str, dict[str, Any]]) -> Any:
    """The ``PlanInput`` of a read recipe; a UserError names a bad value and what is valid."""
    from ssl_xcit.trainer.memory_plan import DEFAULT_MODEL, PlanInput, init_parameters, model_class

    class_path = recipe["model"]["class_path"] or DEFAULT_MODEL
    args = recipe["model"]["init_args"]
    accepted = init_parameters(model_class(class_path))
    unknown = [k for k in args if k not in accepted]
    if unknown:
        raise UserError(f"{class_path} has no argument {unknown[0]!r} (--model.{unknown[0]})")
    trainer, data = recipe["trainer"], recipe["data"]
    precision = str(trainer.get("precision", "bf16-mixed"))
    if precision not in PRECISION_NAMES:
        raise UserError(f"precision {precision!r} cannot be planned; valid: {', '.join(PRECISION_NAMES)}")
    strategy = str(trainer.get("strategy", "ddp"))
    if strategy not in STRATEGY_NAMES:
        raise UserError(f"strategy {strategy!r} cannot be planned; valid: {', '.join(STRATEGY_NAMES)}")
    devices = _int(trainer.get("devices", 1), "--trainer.devices")
    nodes = _int(trainer.get("num_nodes", 1), "--trainer.num_nodes")
    sizes = {k: data[k] for k in DATA_KEYS if k in data}
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"--data.{key} must be an integer, got {value!r}")
    plan = PlanInput(
        dict(args),
        precision=PRECISION_NAMES[precision],
        strategy=STRATEGY_NAMES[strategy],
        world_size=devices * nodes,
        model_class=class_path,
        **sizes,
    )
    plan.check()
    return plan


def _gb(n: int) -> str:
    return f"{n / 1e9:8.2f} GB"


def describe(plan: Any, result: Any, gpu_memory: float) -> str:
    """The plan as a short table."""
    from ssl_xcit.trainer.memory_plan import (
        CUDA_OVERHEAD_GB,
        FRAGMENTATION,
        NCCL_COMMUNICATOR_GB,
        nccl_communicators,
    )

    backbone = plan.model_args.get("backbone", "xcit_small_12_p16")
    ac = "on" if plan.model_args.get("activation_checkpointing") else "off"
    crops = f"2 x {plan.global_crops_size}" + (
        f" + {plan.local_crops_number} x {plan.local_crops_size}" if plan.local_crops_number else ""
    )
    shard = " (this GPU's 1/N shards)" if plan.strategy == "fsdp2" and plan.world_size > 1 else ""
    lines = [
        f"{backbone}: batch {plan.batch_size} per GPU, crops {crops}, {plan.precision}, {plan.strategy} on "
        f"{plan.world_size} GPU{'s' * (plan.world_size > 1)}, activation checkpointing {ac}",
        f"  parameters     {_gb(result.parameters)}  student, float32{shard}",
        f"  gradients      {_gb(result.gradients)}  float32",
        f"  optimiser      {_gb(result.optimizer)}  AdamW, 2 float32 states",
        f"  teachers       {_gb(result.teachers)}  EMA teacher, heads' copies, Gram or distillation teacher",
        f"  activations    {_gb(result.activations)}  and gradients, gathered units, temporaries at the peak",
    ]
    if result.ddp_buckets:
        lines.append(f"  DDP buckets    {_gb(result.ddp_buckets)}  a float32 copy of the gradients")
    lines += [
        f"  traced peak    {_gb(result.traced_peak + result.ddp_buckets)}",
        f"  peak per GPU   {_gb(result.peak)}  traced x {1 + FRAGMENTATION:.2f} + {result.overhead / 1e9:.0f} GB "
        f"(CUDA context and workspaces {CUDA_OVERHEAD_GB:g} GB, NCCL {NCCL_COMMUNICATOR_GB:g} GB x "
        f"{nccl_communicators(plan)} communicator{'s' * (nccl_communicators(plan) != 1)})",
        f"  fits {gpu_memory:g} GB:   {'yes' if result.fits(gpu_memory) else 'NO'}",
    ]
    return "\n".join(lines)


def table(plan: Any, names: list[str], gpu_memory: float) -> list[dict[str, Any]]:
    """For each backbone in ``names``: the largest batch per GPU that fits, under DDP and FSDP2, without and
    with activation checkpointing (the rest of ``plan`` as given): a guess from traces of shallow copies
    (``ssl_xcit.trainer.memory_table``), settled by full-depth traces (``memory_plan.max_batch``); prints a
    Markdown table row by row."""
    from ssl_xcit.models import create_model
    from ssl_xcit.trainer.memory_plan import max_batch
    from ssl_xcit.trainer.memory_table import depth_model

    head = ["backbone", "parameters"] + [f"{s.upper()}{' + AC' if ac else ''}" for s, ac in TABLE_COLUMNS]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head), flush=True)
    rows = []
    for name in names:
        base = replace(plan, model_args={**plan.model_args, "backbone": name})
        kwargs = dict(base.model_args.get("backbone_kwargs") or {})
        params = sum(p.numel() for p in create_model(name, device="meta", **kwargs).parameters())
        row: dict[str, Any] = {"backbone": name, "parameters": params}
        for strategy, ac in TABLE_COLUMNS:
            cell = replace(
                base, strategy=strategy, model_args={**base.model_args, "activation_checkpointing": ac}
            )
            cell.check()
            # The shallow copies' extrapolation is a first guess only: under activation checkpointing the
            # step's peak moves between phases as blocks are added, so every answer is traced at full depth.
            guess = depth_model(cell).max_batch(gpu_memory)
            row[f"{strategy}{'_ac' if ac else ''}"] = max_batch(cell, gpu_memory, first=max(1, guess))[0]
        cells = [str(row[f"{s}{'_ac' if ac else ''}"] or "none") for s, ac in TABLE_COLUMNS]
        print(f"| `{name}` | {params / 1e6:.0f} M | " + " | ".join(cells) + " |", flush=True)
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | list[dict[str, Any]]:
    """Parse ``argv``, print the plan (or the table); returns its numbers."""
    import warnings

    from ssl_xcit.trainer.memory_plan import estimate, max_batch

    parser = argparse.ArgumentParser(
        prog="ssl-xcit plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-c", "--config", help="a recipe, as ssl-xcit fit -c reads it")
    parser.add_argument("--gpu-memory", type=float, default=80.0, help="GB (10^9 bytes) per GPU (default 80)")
    parser.add_argument(
        "--max-batch", action="store_true", help="also find the largest batch per GPU that fits"
    )
    parser.add_argument("--table", help="comma-separated backbones: the largest batch of each, 4 settings")
    args, rest = parser.parse_known_args(None if argv is None else list(argv))
    if not args.gpu_memory > 0:
        raise UserError(f"--gpu-memory must be > 0 GB, got {args.gpu_memory}")
    recipe = read_recipe(args.config)
    apply_overrides(recipe, rest)
    plan = plan_input(recipe)
    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")  # FSDP2's notes about fake tensors
    if args.table:
        return table(plan, [n for n in args.table.split(",") if n], args.gpu_memory)
    result = estimate(plan)
    print(describe(plan, result, args.gpu_memory))
    out: dict[str, Any] = {
        "parameters": result.parameters,
        "gradients": result.gradients,
        "optimizer": result.optimizer,
        "teachers": result.teachers,
        "activations": result.activations,
        "traced_peak": result.traced_peak,
        "peak": result.peak,
        "fits": result.fits(args.gpu_memory),
    }
    if args.max_batch:
        batch, best = max_batch(plan, args.gpu_memory)
        out["max_batch"] = batch
        peak = f" (peak {best.peak / 1e9:.2f} GB)" if best is not None else ""
        print(f"  largest batch per GPU that fits {args.gpu_memory:g} GB: {batch or 'none'}{peak}")
    return out
