"""XCiT speed and memory on CPU, ours next to timm's, measured side by side in one run.

    python benchmarks/bench_xcit.py                 # full run (a few minutes on 2 cores)
    python benchmarks/bench_xcit.py --quick         # fewer repeats, smaller sizes
    python benchmarks/bench_xcit.py --components    # XCA and LPI alone vs timm's, 1 thread, CPU time

1. Forward+backward time of XCiT-S12/16 at 224 and 512, ours vs timm's ``xcit_small_12_p16_224`` with the same
   weights. Runs alternate (ours, timm, ours, ...) so machine noise hits both alike; we print medians and the
   ratio ours/timm (<= 1.0 means ours is not slower).
2. Peak forward memory (inference, ``no_grad``) at 224, 384, 512, 768 and 1024 px, as bytes per token, for our
   XCiT-S12/16 and for timm's ViT-S/16 with materialised (quadratic) attention as in DINO. Each point runs in a
   fresh subprocess and reports the growth of the peak resident set during one forward, so weights and the
   Python runtime are excluded. XCiT must grow linearly: its 1024/224 memory ratio should be within 25% of the
   token-count ratio (4096 / 196 = 20.9).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch


def _time_fwd_bwd(model: torch.nn.Module, x: torch.Tensor) -> float:
    start = time.perf_counter()
    out = model(x)
    out.float().pow(2).mean().backward()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def speed(resolutions: list[int], batch: int, repeats: int) -> list[dict]:
    import timm

    from ssl_xcit.models import create_model

    reference = timm.create_model("xcit_small_12_p16_224", num_classes=0).train()
    ours = create_model("xcit_small_12_p16").train()
    ours.load_state_dict(reference.state_dict())
    rows = []
    for res in resolutions:
        x = torch.randn(batch, 3, res, res)
        for model in (ours, reference):  # warm-up: allocator and oneDNN primitive caches
            _time_fwd_bwd(model, x)
        times: dict[str, list[float]] = {"ours": [], "timm": []}
        for _ in range(repeats):
            times["ours"].append(_time_fwd_bwd(ours, x))
            times["timm"].append(_time_fwd_bwd(reference, x))
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append(
            dict(
                resolution=res,
                batch=batch,
                ours_s=med["ours"],
                timm_s=med["timm"],
                ratio=med["ours"] / med["timm"],
            )
        )
        print(
            f"fwd+bwd S12/16 {res}px batch {batch}: ours {med['ours'] * 1e3:8.1f} ms  timm {med['timm'] * 1e3:8.1f} ms  "
            f"ratio ours/timm {med['ours'] / med['timm']:.3f}",
            flush=True,
        )
    return rows


def components(repeats: int) -> list[dict]:
    """XCA and LPI fwd+bwd alone, ours vs timm's modules with the same weights, on one thread.

    Process CPU time (min of ``repeats``) rather than wall time: it leaves out time spent descheduled, so a
    component-level difference of a few percent is visible on a shared machine.
    """
    from timm.models.xcit import LPI as TimmLPI
    from timm.models.xcit import XCA as TimmXCA

    from ssl_xcit.models.layers import LPI, XCA

    torch.set_num_threads(1)

    def cpu_time(fn, x) -> float:
        best = float("inf")
        for _ in range(repeats + 1):
            xx = x.detach().requires_grad_()
            start = time.process_time()
            fn(xx).pow(2).mean().backward()
            best = min(best, time.process_time() - start)
        return best

    rows = []
    # (batch, grid side): 96 px local crops, 224 px global crops, 512 px.
    for batch, side in [(16, 6), (4, 14), (1, 32)]:
        x = torch.randn(batch, side * side, 384)
        ours_lpi, ref_lpi = LPI(384), TimmLPI(384)
        ref_lpi.load_state_dict(ours_lpi.state_dict())
        ours_xca, ref_xca = XCA(384, 8, qkv_bias=True), TimmXCA(384, 8, qkv_bias=True)
        ref_xca.load_state_dict(ours_xca.state_dict())
        for name, ours, ref in (
            ("LPI", lambda t, m=ours_lpi, n=side: m(t, n, n), lambda t, m=ref_lpi, n=side: m(t, n, n)),
            ("XCA", ours_xca, ref_xca),
        ):
            o, r = cpu_time(ours, x), cpu_time(ref, x)
            rows.append(
                dict(component=name, batch=batch, tokens=side * side, ours_s=o, timm_s=r, ratio=o / r)
            )
            print(
                f"{name} fwd+bwd batch {batch:2d} x {side * side:4d} tokens x 384: ours {o * 1e3:7.2f} ms  "
                f"timm {r * 1e3:7.2f} ms  ratio {o / r:.2f}",
                flush=True,
            )
    return rows


def _peak_forward_child(kind: str, res: int) -> None:
    """Runs in a subprocess: print the peak-RSS growth (bytes) of one inference forward."""
    torch.set_num_threads(1)
    if kind == "xcit":
        from ssl_xcit.models import create_model

        model = create_model("xcit_small_12_p16").eval()
    else:
        import timm
        import timm.layers

        timm.layers.set_fused_attn(False)  # materialise the N x N attention, as DINO's ViT does
        model = timm.create_model("vit_small_patch16_224", num_classes=0, dynamic_img_size=True).eval()
    x = torch.randn(1, 3, res, res)
    with torch.no_grad():
        model(torch.randn(1, 3, 64, 64))  # touch every code path once at a tiny size
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        model(x)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"bytes": (after - before) * 1024}))  # ru_maxrss is in KiB on Linux


def memory(resolutions: list[int]) -> list[dict]:
    rows = []
    for kind in ("xcit", "vit"):
        for res in resolutions:
            # Allocations above 64 KiB go straight to mmap and back on free, so the peak resident set follows
            # the live tensors instead of whatever the heap kept from earlier frees.
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
            out = subprocess.run(
                [sys.executable, __file__, "--child", kind, str(res)],
                capture_output=True,
                text=True,
                check=True,
                env=env,
            )
            peak = json.loads(out.stdout.strip().splitlines()[-1])["bytes"]
            tokens = (res // 16) ** 2
            rows.append(
                dict(
                    model=kind, resolution=res, tokens=tokens, peak_bytes=peak, bytes_per_token=peak / tokens
                )
            )
            print(
                f"peak fwd memory {kind:4s} {res:5d}px {tokens:5d} tokens: {peak / 2**20:9.1f} MiB "
                f"= {peak / tokens / 1024:8.1f} KiB/token",
                flush=True,
            )
    for kind in ("xcit", "vit"):
        pts = {r["resolution"]: r for r in rows if r["model"] == kind}
        lo, hi = min(pts), max(pts)
        mem_ratio = pts[hi]["peak_bytes"] / pts[lo]["peak_bytes"]
        tok_ratio = pts[hi]["tokens"] / pts[lo]["tokens"]
        print(
            f"{kind}: memory {hi}/{lo} = {mem_ratio:.1f}x for {tok_ratio:.1f}x tokens "
            f"(memory ratio / token ratio = {mem_ratio / tok_ratio:.2f})"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 repeats and batch 2: a smoke run")
    parser.add_argument("--repeats", type=int, default=7, help="timed fwd+bwd runs per model and resolution")
    parser.add_argument("--batch", type=int, default=4, help="batch size at 224 px (512 px uses a quarter)")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--components", action="store_true", help="only time XCA and LPI alone vs timm's")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "RES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _peak_forward_child(args.child[0], int(args.child[1]))
        return
    repeats = 3 if args.quick else args.repeats
    if args.components:
        components(max(repeats, 9))
        return
    batch = 2 if args.quick else args.batch
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if not args.skip_speed:
        speed([224], batch, repeats)
        speed([512], max(1, batch // 4), repeats)
    if not args.skip_memory:
        memory([224, 384, 512, 768, 1024])


if __name__ == "__main__":
    main()
