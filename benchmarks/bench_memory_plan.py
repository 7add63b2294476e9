"""``ssl-xcit plan``'s estimate against the peak measured on this CPU, side by side.

    python benchmarks/bench_memory_plan.py                  # the default small configurations
    python benchmarks/bench_memory_plan.py --configs ddp-32,ddp-bf16-ac --batch-size 16

For each configuration the estimate (``ssl_xcit.trainer.memory_plan.estimate``: fake tensors, torch's
``MemTracker``) is made in this process, and the peak is measured in a fresh process that runs the same step
on real CPU tensors. The measurement is the CPU allocator's own record, a different mechanism from the
estimate's: ``torch.profiler`` with ``profile_memory=True`` logs every allocation and free of the c10 CPU
allocator with its bytes; the peak is the largest running sum over the process's work from before the model
is built (weights, teachers, AdamW's states, the batch, every activation and temporary), through the AdamW
states' first step and one measured step.

``fsdp2`` is measured twice. First in one process over a fake process group of ``--world-size`` ranks (torch's
``fake`` backend: real tensors, FSDP2's own shards, gathers and reduction buffers, but no collective moves
data), which repeats exactly: that is the measurement the estimate is compared with. Then ``--repeats`` times on
``--world-size`` gloo processes (rank 0's peak), which do not repeat: gloo's own threads allocate staging
buffers, and a collective's buffers stay referenced until the peer's data has arrived, so what is alive at the
peak depends on how far apart the ranks run. Prints each configuration's traced estimate, its measured peak and their ratio, and for
``fsdp2`` the smallest and largest gloo peak.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(
    backbone="xcit_nano_12_p8",
    backbone_kwargs={"depth": 2},
    out_dim=1024,
    head_hidden_dim=256,
    head_bottleneck_dim=64,
)
# ViT-S/16 cut to 2 blocks: a second family, with no BatchNorm (XCiT's are float32 FSDP2 units of their own).
SMALL_VIT = dict(SMALL, backbone="vit_small_patch16_224")
# Distillation (ssl_xcit.dino.distill.Distill) into the small XCiT from a frozen DINO ViT-S/16 of 2 blocks, written
# by this script as our checkpoint (:func:`teacher_file`); "teacher" names it when a configuration is planned.
DISTILL = dict(SMALL, model_class="ssl_xcit.dino.distill.Distill", teacher=None)
# name -> (precision, strategy, activation checkpointing, model)
CONFIGS = {
    "ddp-32": ("32", "ddp", False, SMALL),
    "ddp-32-ac": ("32", "ddp", True, SMALL),
    "ddp-bf16": ("bf16-mixed", "ddp", False, SMALL),
    "ddp-bf16-ac": ("bf16-mixed", "ddp", True, SMALL),
    "ddp-bf16-ac-vit": ("bf16-mixed", "ddp", True, SMALL_VIT),
    "fsdp2-32": ("32", "fsdp2", False, SMALL),
    "fsdp2-bf16-ac": ("bf16-mixed", "fsdp2", True, SMALL_VIT),
    "fsdp2-bf16-xcit": ("bf16-mixed", "fsdp2", False, SMALL),
    "fsdp2-bf16-ac-xcit": ("bf16-mixed", "fsdp2", True, SMALL),
    "ddp-bf16-distill": ("bf16-mixed", "ddp", False, DISTILL),
    "fsdp2-bf16-distill": ("bf16-mixed", "fsdp2", False, DISTILL),
}


@functools.cache
def teacher_file() -> Path:
    """A DINO ViT-S/16 of 2 blocks with its head, saved as our checkpoint in a temporary folder (made once per
    process, removed at exit): the distillation configurations' teacher."""
    import atexit
    import shutil
    import tempfile

    import torch

    from ssl_xcit.dino.module import DINO

    folder = Path(tempfile.mkdtemp(prefix="bench_memory_plan_"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    torch.manual_seed(0)
    dino = DINO("vit_small_patch16_224", backbone_kwargs={"depth": 2}, out_dim=1024, head_hidden_dim=256,
                head_bottleneck_dim=64)  # fmt: skip
    path = folder / "teacher.ckpt"
    torch.save({"state_dict": dino.state_dict(), "hyper_parameters": dict(dino.hparams)}, path)
    return path


def plan_for(name: str, batch_size: int = 8, world_size: int = 2, model_args: dict | None = None) -> Any:
    """The PlanInput of configuration ``name`` (:data:`CONFIGS`) on the small model."""
    from ssl_xcit.trainer.memory_plan import PlanInput

    precision, strategy, ac, model = CONFIGS[name]
    args = {**(model_args or model), "activation_checkpointing": ac}
    model_class = args.pop("model_class", None)
    if "teacher" in args and args["teacher"] is None:
        args["teacher"] = str(teacher_file())
    return PlanInput(
        args,
        **({"model_class": model_class} if model_class else {}),
        batch_size=batch_size,
        global_crops_size=64,
        local_crops_number=4,
        local_crops_size=32,
        precision=precision,
        strategy=strategy,
        world_size=world_size if strategy == "fsdp2" else 1,
    )


def allocator_peak(events: Any) -> int:
    """The largest running sum of the CPU allocator's allocations (+bytes) and frees (-bytes), in time order."""
    memory = sorted(
        (e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type().name == "CPU"
    )
    live = peak = 0
    for _, nbytes in memory:
        live += nbytes
        peak = max(peak, live)
    return peak


def measure_here(plan_json: str) -> int:
    """The measured peak of one steady-state step of ``plan_json`` (a PlanInput as JSON) in this process (one
    rank of ``fsdp2``: the process group must be up)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ssl_xcit.trainer.memory_plan import PlanInput, build, init_optimizer_states, training_steps

    plan = PlanInput(**json.loads(plan_json))
    torch.manual_seed(0)
    mesh = None
    if plan.strategy == "fsdp2" and plan.world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (plan.world_size,), mesh_dim_names=("data_parallel",))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model, optimizer = build(plan, mesh)
        init_optimizer_states(model, optimizer)
        training_steps(model, optimizer, plan, steps=1)
    return allocator_peak(prof.profiler.kineto_results.events())


def _worker(rank: int, plan_json: str, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    world = json.loads(plan_json)["world_size"]
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        peak = measure_here(plan_json)
        if rank == 0:
            Path(out).write_text(str(peak))
    finally:
        dist.destroy_process_group()


def measure(plan: Any, timeout: float = 600, transport: str = "fake") -> int:
    """The measured peak of ``plan`` in a fresh process; under fsdp2 over a fake process group of ``world_size``
    ranks in that process (``transport="fake"``) or on ``world_size`` gloo processes (``"gloo"``)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    script = str(Path(__file__).resolve())
    cmd = [sys.executable, script, "--measure", json.dumps(asdict(plan)), "--transport", transport]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measurement failed:\n{done.stderr[-3000:]}")
    return int(done.stdout.strip().splitlines()[-1])


def _measure_main(plan_json: str, transport: str) -> None:
    import tempfile
    import warnings

    warnings.filterwarnings("ignore")
    world = json.loads(plan_json)["world_size"]
    if json.loads(plan_json)["strategy"] != "fsdp2" or world == 1:
        print(measure_here(plan_json))
        return
    if transport == "fake":
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            print(measure_here(plan_json))
        finally:
            dist.destroy_process_group()
        return
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "peak")
        mp.spawn(_worker, args=(plan_json, port, out), nprocs=world, join=True)
        print(Path(out).read_text())


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--world-size", type=int, default=2, help="ranks of the fsdp2 configurations")
    p.add_argument("--repeats", type=int, default=3, help="gloo runs of each fsdp2 configuration (0: none)")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    p.add_argument("--transport", default="fake", choices=("fake", "gloo"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        _measure_main(args.measure, args.transport)
        return []
    import warnings

    from ssl_xcit.trainer.memory_plan import estimate

    warnings.filterwarnings("ignore")
    rows = []
    print(
        f"{'config':18s} {'estimate MB':>12s} {'measured MB':>12s} {'ratio':>7s} {'gloo MB (min-max)':>18s}"
    )
    for name in args.configs.split(","):
        plan = plan_for(name, args.batch_size, args.world_size)
        est = estimate(plan).traced_peak
        meas = measure(plan)
        gloo = [measure(plan, transport="gloo") for _ in range(args.repeats)] if plan.world_size > 1 else []
        rows.append(dict(config=name, estimate=est, measured=meas, ratio=est / meas, gloo=gloo))
        spread = f"{min(gloo) / 1e6:.2f}-{max(gloo) / 1e6:.2f}" if gloo else ""
        print(f"{name:18s} {est / 1e6:12.2f} {meas / 1e6:12.2f} {est / meas:7.3f} {spread:>18s}", flush=True)
    return rows


if __name__ == "__main__":
    main()
