"""Training-step throughput of DINO: forward (teacher + student), backward, per-parameter clipping, AdamW step
and the EMA update, in images/s, with 2 global + N local crops.

    python benchmarks/bench_train_step.py                                  # XCiT-N12/16, 224/96 px, 2+8 crops
    python benchmarks/bench_train_step.py --global-size 64 --local-size 32 --local-crops 4 --batch-size 32
    python benchmarks/bench_train_step.py --device cuda --model xcit_small_12_p16 --batch-size 64 --amp

Two student forward strategies are timed side by side in one run: crops of the same resolution batched into
one backbone call (what ``DINO`` does, ``MultiCropWrapper``) and one backbone call per crop. Medians over
``--steps`` timed steps after ``--warmup`` untimed ones.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ssl_xcit.dino.loss import DINOLoss
from ssl_xcit.dino.module import DINO
from ssl_xcit.dino.optim import build_optimizer, clip_gradients, get_params_groups


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="xcit_nano_12_p16")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--global-size", type=int, default=224)
    p.add_argument("--local-size", type=int, default=96)
    p.add_argument("--local-crops", type=int, default=8)
    p.add_argument("--out-dim", type=int, default=65536)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = DINO(args.model, out_dim=args.out_dim).to(device)
    model.train()
    loss_fn: DINOLoss = model.dino_loss
    optimizer = build_optimizer("adamw", get_params_groups(model.student))
    for group in optimizer.param_groups:
        group["lr"] = 1e-5
    b = args.batch_size
    crops = [torch.randn(b, 3, args.global_size, args.global_size, device=device) for _ in range(2)]
    crops += [
        torch.randn(b, 3, args.local_size, args.local_size, device=device) for _ in range(args.local_crops)
    ]

    def per_crop_student(views):
        return model.student.head(torch.cat([model.student.backbone(v) for v in views]))

    def step(student_forward) -> float:
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
            with torch.no_grad():
                teacher_out = model.teacher(crops[:2])
            loss = loss_fn(student_forward(crops), teacher_out, epoch=0).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip_gradients(model.student, 3.0)
        optimizer.step()
        model._update_teacher(0.996)
        sync()
        return time.perf_counter() - start

    results = {}
    for name, forward in (("batched by resolution", model.student), ("one call per crop", per_crop_student)):
        for _ in range(args.warmup):
            step(forward)
        times = [step(forward) for _ in range(args.steps)]
        results[name] = statistics.median(times)
    print(
        f"{args.model} on {args.device} ({torch.get_num_threads()} threads), batch {b}, "
        f"2x{args.global_size}px + {args.local_crops}x{args.local_size}px crops, out_dim {args.out_dim}, "
        f"amp={args.amp}; median of {args.steps} steps"
    )
    for name, seconds in results.items():
        print(f"  {name:24s} {seconds * 1000:9.1f} ms/step  {b / seconds:8.2f} images/s")
    base = results["one call per crop"]
    print(f"  batched / per-crop speed-up: {base / results['batched by resolution']:.2f}x")


if __name__ == "__main__":
    main()
