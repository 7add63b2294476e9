"""The frozen teacher's share of a distillation step (``ssl_xcit.dino.distill``): step time with and without it.

    python benchmarks/bench_distill.py                                   # timm ViT-S/16 -> XCiT-N12/8, 64 px
    python benchmarks/bench_distill.py --teacher vit_base_patch16_224 --student xcit_nano_12_p8 --size 224
    python benchmarks/bench_distill.py --device cuda --size 224 --batch-size 64 --amp

A step is the ``features`` objective's: the teacher's tokens of the 2 x B global crops in one no-grad forward,
the student's forward and backward, an AdamW step. "Without the teacher" replays the same step on tokens
computed once beforehand. Medians over ``--steps`` timed steps after ``--warmup`` untimed ones, in one process;
the teacher's architecture comes from timm with random weights (the timing does not depend on them).
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import timm
import torch

from ssl_xcit.dino.distill import Distill, FrozenTeacher


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", default="vit_small_patch16_224", help="a timm model name")
    p.add_argument("--student", default="xcit_nano_12_p8")
    p.add_argument("--size", type=int, default=64, help="global crop side (the teacher sees the same)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    return p.parse_args()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> dict[str, float]:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    timm_teacher = timm.create_model(args.teacher, num_classes=0, dynamic_img_size=True)
    frozen = FrozenTeacher(timm_teacher, f"timm:{args.teacher}", probe_size=args.size)
    with mock.patch("ssl_xcit.dino.distill.read_teacher", return_value=frozen):
        model = Distill(teacher=f"timm:{args.teacher}", backbone=args.student, out_dim=16).to(args.device)
    opt = torch.optim.AdamW(model.student.parameters(), lr=1e-4)
    crops = [torch.randn(args.batch_size, 3, args.size, args.size, device=args.device) for _ in range(2)]
    cached = model.teacher_tokens(torch.cat(crops))

    def step(with_teacher: bool) -> float:
        _sync(args.device)
        start = time.perf_counter()
        with torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=args.amp):
            if with_teacher:
                out = model.compute_losses(crops, None, 0, update_center=True)
            else:
                with mock.patch.object(model, "teacher_tokens", return_value=cached):
                    out = model.compute_losses(crops, None, 0, update_center=True)
        opt.zero_grad(set_to_none=True)
        out.total.backward()
        opt.step()
        _sync(args.device)
        return time.perf_counter() - start

    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.warmup + args.steps):
        for with_teacher in (True, False):  # interleaved: both see the same machine load
            elapsed = step(with_teacher)
            if i >= args.warmup:
                times[with_teacher].append(elapsed)
    full, without = (statistics.median(times[flag]) for flag in (True, False))
    share = 1.0 - without / full
    print(
        f"teacher {args.teacher} -> student {args.student}, {args.size} px, 2 x {args.batch_size} global crops, "
        f"{args.device}{' bf16' if args.amp else ''}, threads {torch.get_num_threads()}"
    )
    print(f"step with the teacher:    {1000 * full:8.1f} ms (median of {args.steps})")
    print(f"step without the teacher: {1000 * without:8.1f} ms")
    print(f"ratio {full / without:.2f}: the teacher's forward is {100 * share:.0f} % of a step")
    return {"with_teacher_s": full, "without_teacher_s": without, "teacher_share": share}


if __name__ == "__main__":
    main()
