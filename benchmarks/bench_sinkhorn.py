"""Peak memory of Sinkhorn-Knopp at DINOv2's masked-patch shape: the former float64 algorithm against ours.

    python benchmarks/bench_sinkhorn.py [--patches 3700] [--prototypes 65536]

Each algorithm runs in a fresh subprocess on the CPU from the same float32 scores (patches x prototypes,
logits / temperature, as the iBOT term passes them); the peak is the process's maximum resident set size
(``resource.getrusage``) minus the one after the scores were made, so only the algorithm's own memory counts.
Prints both peaks and their ratio side by side, and the largest difference of the targets.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch


def former_float64(scores: torch.Tensor, iterations: int = 3) -> torch.Tensor:
    """The algorithm before (kept only here, for the comparison): a float64 copy of every intermediate."""
    out_dtype = scores.dtype
    scores = scores.double()
    peak = scores.max().reshape(1)
    q = torch.exp(scores - peak).t()
    k = q.shape[0]
    batch = torch.tensor([float(q.shape[1])], dtype=q.dtype)
    q /= q.sum()
    for _ in range(iterations):
        q /= q.sum(dim=1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny) * k
        q /= q.sum(dim=0, keepdim=True) * batch
    return (q * batch).t().to(out_dtype)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _child(which: str, patches: int, prototypes: int) -> None:
    from ssl_xcit.dino.loss import sinkhorn_knopp

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(patches, prototypes, generator=g).mul_(2).sub_(1).div_(0.07)  # cosine logits / temp
    base = _rss_mb()
    # The iBOT term hands over its temporary (logits / temperature): ours works in it.
    out = former_float64(scores) if which == "float64" else sinkhorn_knopp(scores, inplace=True)
    peak = _rss_mb() - base
    print(json.dumps({"peak_mb": peak, "row0": out[0, :8].tolist(), "shape": list(out.shape)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patches", type=int, default=3700, help="masked patches in the global batch")
    parser.add_argument("--prototypes", type=int, default=65536, help="patch head prototypes (K)")
    parser.add_argument("--child", choices=("float64", "float32"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.patches, args.prototypes)
        return
    results = {}
    for which in ("float64", "float32"):
        cmd = [sys.executable, __file__, "--child", which, f"--patches={args.patches}"]
        cmd.append(f"--prototypes={args.prototypes}")
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        results[which] = json.loads(done.stdout.strip().splitlines()[-1])
    scores_mb = args.patches * args.prototypes * 4 / 2**20
    diff = max(
        abs(a - b) for a, b in zip(results["float64"]["row0"], results["float32"]["row0"], strict=True)
    )
    print(f"Sinkhorn-Knopp, {args.patches} masked patches x {args.prototypes} prototypes "
          f"(scores: {scores_mb:.0f} MB float32), peak memory above the scores, CPU:")  # fmt: skip
    print(f"{'float64 (before)':>18} {results['float64']['peak_mb']:9.0f} MB")
    print(f"{'float32 (now)':>18} {results['float32']['peak_mb']:9.0f} MB")
    print(f"{'ratio':>18} {results['float64']['peak_mb'] / max(results['float32']['peak_mb'], 1):9.1f} x")
    print(f"largest target difference on row 0: {diff:.2e}")


if __name__ == "__main__":
    main()
