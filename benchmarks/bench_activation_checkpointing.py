"""Activation checkpointing's memory saving and time cost on a DINO training step, side by side.

    python benchmarks/bench_activation_checkpointing.py                       # XCiT-T12/16 and ViT-S/16
    python benchmarks/bench_activation_checkpointing.py --models xcit_small_12_p16 --batch-size 8

For each model, one process per setting (with and without ``--model.activation_checkpointing``) builds DINO
and AdamW on one thread, takes ``--warmup`` untimed steps (the optimiser state then exists), then times ``--steps`` steps:
teacher and student forwards on 2 global + N local crops, the DINO loss, backward, per-parameter clipping,
the AdamW step and the EMA. Memory is the step's growth of the resident set: the peak (``VmHWM``, reset
through ``/proc/self/clear_refs`` after the warm-up) minus the resident set before the timed steps, so the
weights, the optimiser state and the data are not counted (glibc's mmap threshold is fixed at 128 KiB in the
measured processes, so freed tensors leave the resident set; tensors below it and reused heap are not seen, so
this undercounts). A second, exact measure is what one forward keeps for the backward (``saved_tensors_hooks``,
the parameters' own storages excluded): the activations checkpointing drops. Linux only. Prints each setting and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="xcit_tiny_12_p16,vit_small_patch16_224")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--global-size", type=int, default=224)
    p.add_argument("--local-size", type=int, default=96)
    p.add_argument("--local-crops", type=int, default=4)
    p.add_argument("--out-dim", type=int, default=4096)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--backbone-kwargs", default="{}", help="JSON create_model overrides, e.g. '{\"depth\": 2}'"
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # MODEL:0|1, one measured setting
    return p.parse_args(argv)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(args: argparse.Namespace, model_name: str, checkpointing: bool) -> dict:
    """One setting, in this process: median CPU time of a step on one thread (s; the process's CPU time, so
    other jobs on the machine do not count) and the step's resident-set growth (MiB)."""
    import gc

    import torch

    from ssl_xcit.dino.module import DINO
    from ssl_xcit.dino.optim import build_optimizer, clip_gradients, get_params_groups

    torch.set_num_threads(1)  # CPU time of one thread: comparable on a machine shared with other jobs
    torch.manual_seed(0)
    model = DINO(model_name, backbone_kwargs=json.loads(args.backbone_kwargs), out_dim=args.out_dim,
                 activation_checkpointing=checkpointing)  # fmt: skip
    model.train()
    opt = build_optimizer("adamw", get_params_groups(model.student))
    b = args.batch_size
    crops = [torch.randn(b, 3, args.global_size, args.global_size) for _ in range(2)]
    crops += [torch.randn(b, 3, args.local_size, args.local_size) for _ in range(args.local_crops)]

    def step() -> None:
        out = model.compute_losses(crops, None, epoch=0, update_center=True)
        out.total.backward()
        clip_gradients(model.student, 3.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model._update_teacher(0.996)

    for _ in range(args.warmup):
        step()
    # What the forward keeps for the backward, parameters aside: the activations checkpointing drops.
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.compute_losses(crops, None, epoch=0, update_center=False)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    before = _status_kib("VmRSS")
    times = []
    for _ in range(args.steps):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    peak = (_status_kib("VmHWM") - before) / 1024
    return {"step_s": statistics.median(times), "peak_mib": peak, "saved_mib": sum(kept.values()) / 2**20}


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.child is not None:
        name, flag = args.child.rsplit(":", 1)
        print(json.dumps(measure(args, name, flag == "1")))
        return []
    rows = []
    for name in args.models.split(","):
        result = {}
        for flag in ("0", "1"):
            cmd = [
                sys.executable,
                __file__,
                *(argv if argv is not None else sys.argv[1:]),
                "--child",
                f"{name}:{flag}",
            ]
            # A fixed mmap threshold: every tensor above 128 KiB is its own mapping, returned to the system when
            # freed, so the resident set follows the live tensors (glibc's adaptive threshold keeps freed
            # activations resident, and the timed step would reuse them unseen).
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            result[flag] = json.loads(out.strip().splitlines()[-1])
        row = {
            "model": name,
            "peak_mib": result["0"]["peak_mib"],
            "peak_mib_ac": result["1"]["peak_mib"],
            "memory_ratio": result["1"]["peak_mib"] / result["0"]["peak_mib"],
            "saved_mib": result["0"]["saved_mib"],
            "saved_mib_ac": result["1"]["saved_mib"],
            "saved_ratio": result["1"]["saved_mib"] / result["0"]["saved_mib"],
            "step_s": result["0"]["step_s"],
            "step_s_ac": result["1"]["step_s"],
            "time_ratio": result["1"]["step_s"] / result["0"]["step_s"],
        }
        rows.append(row)
    print(
        f"batch {args.batch_size}, 2 x {args.global_size} + {args.local_crops} x {args.local_size} px crops"
    )
    head = [
        "model",
        "kept MiB",
        "with AC",
        "ratio",
        "step MiB",
        "with AC",
        "ratio",
        "CPU s",
        "with AC",
        "ratio",
    ]
    print(f"{head[0]:<24}" + "".join(f"{h:>9}" for h in head[1:]))
    keys = ["saved_mib", "saved_mib_ac", "saved_ratio", "peak_mib", "peak_mib_ac", "memory_ratio"]
    keys += ["step_s", "step_s_ac", "time_ratio"]
    for r in rows:
        cells = [f"{r[k]:>9.2f}" if "ratio" in k or "step_s" in k else f"{r[k]:>9.0f}" for k in keys]
        print(f"{r['model']:<24}" + "".join(cells))
    return rows


if __name__ == "__main__":
    main()
