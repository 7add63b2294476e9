"""Forward+backward cost of each backbone family's small variant next to XCiT-S12/16, on CPU, batch 1.

    python benchmarks/bench_backbones.py                    # default run (~9 min wall on a busy shared 2-core CPU)
    python benchmarks/bench_backbones.py --repeats 2        # figures quoted for issue 9 (~12 min there)
    python benchmarks/bench_backbones.py --quick            # 224 and 96 px only, one timed repeat
    python benchmarks/bench_backbones.py --full             # also CaiT at 768/1024 px (tens of GB, very slow)

For every (model, resolution) a fresh subprocess builds the model, runs one tiny fwd+bwd (so parameter gradients
and allocator/oneDNN caches exist before measuring), then one fwd+bwd at the resolution while recording the growth
of the peak resident set (VmHWM, reset just before): the memory the activations of that pass need (weights, gradients and the Python runtime
excluded), as benchmarks/bench_xcit.py does for forward passes. The same process then times ``--repeats``
further fwd+bwd passes and keeps the fastest, in process CPU time on one thread: time spent descheduled by other
jobs on a shared machine is left out, so the figures compare the models, not the scheduler.

"Tokens" are 16 x 16 patches, (H/16)(W/16), for every family, so per-token figures compare the same image area
(CrossFormer++ starts at stride 4 and BiXT-Ti/16 has 64 latents besides its tokens). Ratios are to XCiT-S12/16
at the same resolution, from this one run. The paper's picture: XCiT, CrossFormer++ and BiXT grow linearly with
the number of tokens (constant KiB/token), CaiT quadratically.

Models: XCiT-S12/16 (``ssl_xcit.models.create_model``), CaiT-XXS24 (the registry's ``cait_xxs24`` when it knows
it, else timm's ``cait_xxs24_224`` built at the input size: same cost as interpolating its positional grid),
CrossFormer++-S and BiXT-Ti/16 (the registry when it knows them, else their modules).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import time

import torch

MODELS = {  # label -> registry name
    "XCiT-S12/16": "xcit_small_12_p16",
    "CaiT-XXS24": "cait_xxs24",
    "CrossFormer++-S": "crossformerpp_small",
    "BiXT-Ti/16": "bixt_ti_l64_p16",
}
QUADRATIC = {"CaiT-XXS24"}
RESOLUTIONS = [224, 384, 512, 768, 1024]
# CaiT-XXS24 keeps ~4 (B, heads, N, N) float maps per talking-heads layer for the backward (backbones.md 4):
# at 768 px that is 24 layers x 4 x 4 x 2304^2 x 4 B ~ 8 GiB, at 1024 px ~ 26 GiB: beyond a shared 23 GiB machine.
QUADRATIC_MAX_DEFAULT = 512


def build(label: str, res: int) -> torch.nn.Module:
    """The model for ``label``: through the registry when it knows the name, else the family's own builder."""
    from ssl_xcit import models

    name = MODELS[label]
    try:
        return models.create_model(name)
    except (ValueError, KeyError):
        pass
    if name.startswith("crossformerpp"):
        from ssl_xcit.models.crossformerpp import create

        return create(name)
    if name.startswith("bixt"):
        from ssl_xcit.models.bixt import create

        return create(name)
    import timm

    return timm.create_model(f"{name}_224", img_size=res, num_classes=0)


def _fwd_bwd(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).float().pow(2).mean().backward()
    model.zero_grad(set_to_none=False)  # keep the gradient buffers: they are not activation memory


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1))


def _reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0), so earlier peaks (the warm-up
    model) do not hide this pass's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _child(label: str, res: int, repeats: int) -> None:
    """Runs in a fresh subprocess: print peak-RSS growth (bytes) of one fwd+bwd, then the fastest CPU time."""
    torch.set_num_threads(1)
    model = build(label, res).train()
    for p in model.parameters():  # gradient buffers exist before measuring: they are not activation memory
        p.grad = torch.zeros_like(p)
    # warm the allocator, lazy initialisation and oneDNN caches at 64 px (timm's CaiT is built for one size, so a
    # second instance built for 64 px warms the same code paths)
    warm = model if "CaiT" not in label else build(label, 64).train()
    _fwd_bwd(warm, torch.randn(1, 3, 64, 64))
    del warm
    x = torch.randn(1, 3, res, res)
    gc.collect()
    _reset_peak_rss()
    before = _status_kib("VmRSS")
    _fwd_bwd(model, x)
    after = _status_kib("VmHWM")
    times = []
    for _ in range(repeats):
        # process CPU time on one thread leaves out time spent descheduled by other jobs on a shared machine
        start = time.process_time()
        _fwd_bwd(model, x)
        times.append(time.process_time() - start)
    print(json.dumps({"bytes": (after - before) * 1024, "seconds": min(times)}))


def measure(label: str, res: int, repeats: int) -> dict:
    # Allocations above 64 KiB go straight to mmap and back on free, so the peak resident set follows the live
    # tensors instead of whatever the heap kept from earlier frees (as bench_xcit.py).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, __file__, "--child", label, str(res), str(repeats)],
        capture_output=True,
        text=True,
        env=env,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{label} at {res}px failed:\n{out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    tokens = (res // 16) ** 2
    return dict(
        model=label, resolution=res, tokens=tokens, ms=result["seconds"] * 1e3, peak_bytes=result["bytes"]
    )


def table(rows: list[dict]) -> str:
    base = {r["resolution"]: r for r in rows if r["model"] == "XCiT-S12/16"}
    lines = [
        "| model | px | tokens | fwd+bwd CPU ms | ms/token | peak MiB | KiB/token | time / XCiT | memory / XCiT |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ref = base.get(r["resolution"])
        t_ratio = f"{r['ms'] / ref['ms']:.2f}" if ref else "-"
        m_ratio = f"{r['peak_bytes'] / ref['peak_bytes']:.2f}" if ref and ref["peak_bytes"] > 0 else "-"
        lines.append(
            f"| {r['model']} | {r['resolution']} | {r['tokens']} | {r['ms']:.0f} | {r['ms'] / r['tokens']:.2f} | "
            f"{r['peak_bytes'] / 2**20:.0f} | {r['peak_bytes'] / r['tokens'] / 1024:.1f} | {t_ratio} | {m_ratio} |"
        )
    return "\n".join(lines)


def growth(rows: list[dict]) -> str:
    """Per model: memory and time ratio between its largest and smallest resolution, over the token ratio."""
    out = []
    for label in MODELS:
        pts = {r["resolution"]: r for r in rows if r["model"] == label and r["resolution"] >= 224}
        if len(pts) < 2:
            continue
        lo, hi = min(pts), max(pts)
        tok = pts[hi]["tokens"] / pts[lo]["tokens"]
        mem = pts[hi]["peak_bytes"] / pts[lo]["peak_bytes"]
        tim = pts[hi]["ms"] / pts[lo]["ms"]
        out.append(
            f"{label}: {lo}->{hi}px: {tok:.1f}x tokens, memory {mem:.1f}x (/tokens {mem / tok:.2f}), "
            f"time {tim:.1f}x (/tokens {tim / tok:.2f})"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="224 and 96 px only, one timed repeat")
    parser.add_argument("--full", action="store_true", help="also run quadratic models above 512 px")
    parser.add_argument(
        "--repeats", type=int, default=1, help="timed fwd+bwd passes per point (fastest kept)"
    )
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]), int(args.child[2]))
        return
    resolutions = [224] if args.quick else RESOLUTIONS
    repeats = 1 if args.quick else args.repeats
    print(f"torch {torch.__version__}, 1 thread, batch 1, fwd+bwd, tokens = (px/16)^2", flush=True)
    rows = []
    for label in args.models:
        for res in resolutions:
            if label in QUADRATIC and res > QUADRATIC_MAX_DEFAULT and not args.full:
                print(
                    f"skip {label} at {res}px: quadratic attention maps kept for the backward need ~8 GiB at 768 px "
                    f"and ~26 GiB at 1024 px (beyond this shared machine); --full runs them",
                    flush=True,
                )
                continue
            rows.append(measure(label, res, repeats))
            r = rows[-1]
            print(f"{label:16s} {res:5d}px {r['ms']:9.0f} ms {r['peak_bytes'] / 2**20:9.0f} MiB", flush=True)
    crops = [measure(label, 96, repeats) for label in args.models]
    print("\n" + table(rows))
    print("\n96 px local crop (36 tokens) relative to the same model's 224 px global crop:")
    print("| model | 96 px ms | 96 px MiB | time 96/224 | memory 96/224 |\n|---|---|---|---|---|")
    for c in crops:
        g = next(r for r in rows if r["model"] == c["model"] and r["resolution"] == 224)
        print(
            f"| {c['model']} | {c['ms']:.0f} | {c['peak_bytes'] / 2**20:.0f} | {c['ms'] / g['ms']:.2f} | "
            f"{c['peak_bytes'] / max(g['peak_bytes'], 1):.2f} |"
        )
    print("\n" + growth(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows + [dict(c, crop=True) for c in crops], f, indent=1)


if __name__ == "__main__":
    main()
