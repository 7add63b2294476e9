"""Peak memory of the Gram anchoring term (``ssl_xcit.dino.gram.gram_loss``, forward and backward) at XCiT-S12/8's
patch grid: all images at once ("plain") against chunks of images, each checkpointed ("chunked").

    python benchmarks/bench_gram.py [--sizes 224 448] [--batch 32] [--plain-batch 32 8] [--dim 384] [--patch 8]
                                    [--chunk-mib M]

``--batch`` counts global crops (the term's images: 2 per image of a DINO batch). Each case runs in a fresh
subprocess on the CPU from random float32 patch features of the student (with gradient) and the Gram teacher;
the peak is the process's maximum resident set size (``resource.getrusage``) minus the one after the features
were made (and a warm-up on 4 tokens had run), so only the term's own memory counts. The Gram teacher's forward (no gradient, freed before the
term) is not included. ``--plain-batch`` gives the batches the plain form is measured at (it grows as
batch x tokens^2, so at 448 px a full batch may not fit a small machine); ``matrix MB`` is one float32 Gram
matrix of the whole batch, batch x tokens^2 x 4 bytes, which the plain form holds a few of at its peak.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

PLAIN_BYTES = 2**62  # a chunk budget no batch reaches: one chunk, no checkpointing


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(mode: str, batch: int, tokens: int, dim: int, chunk_bytes: int | None = None) -> dict:
    """Run the term once (forward and backward) in this process; its peak RSS increase, time and loss.
    ``chunk_bytes``: the chunked form's budget (None: ``ssl_xcit.dino.gram.CHUNK_BYTES``)."""
    from ssl_xcit.dino.gram import CHUNK_BYTES, gram_loss

    chunk_bytes = chunk_bytes or CHUNK_BYTES
    g = torch.Generator().manual_seed(0)
    student = torch.randn(batch, tokens, dim, generator=g).requires_grad_()
    teacher = torch.randn(batch, tokens, dim, generator=g)
    # Warm-up on 4 tokens: the first forward and backward load kernels and start autograd, not the term.
    small = torch.randn(2, 4, dim, requires_grad=True)
    gram_loss(small, small.detach(), chunk_bytes=4).backward()
    base = _rss_mb()
    start = time.perf_counter()
    loss = gram_loss(student, teacher, chunk_bytes=PLAIN_BYTES if mode == "plain" else chunk_bytes)
    loss.backward()
    seconds = time.perf_counter() - start
    per_chunk = batch if mode == "plain" else max(1, chunk_bytes // (4 * tokens * tokens))
    return {
        "peak_mb": _rss_mb() - base,
        "seconds": seconds,
        "loss": float(loss.detach()),
        "images_per_chunk": min(per_chunk, batch),
    }


def _child(args: list[str]) -> None:
    mode, batch, tokens, dim, chunk_bytes = args[0], *map(int, args[1:])
    torch.set_num_threads(1)
    print(json.dumps(measure(mode, batch, tokens, dim, chunk_bytes or None)))


def _run(mode: str, batch: int, tokens: int, dim: int, chunk_bytes: int) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, str(batch), str(tokens), str(dim), str(chunk_bytes)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[224, 448], help="crop sides (px)")
    parser.add_argument("--batch", type=int, default=32, help="global crops for the chunked form")
    parser.add_argument(
        "--plain-batch", type=int, nargs="*", default=[32, 8], help="batches for the plain form"
    )
    parser.add_argument("--dim", type=int, default=384, help="patch feature width (XCiT-S12: 384)")
    parser.add_argument("--patch", type=int, default=8, help="patch size (XCiT-S12/8: 8)")
    parser.add_argument(
        "--chunk-mib",
        type=int,
        default=0,
        help="the chunked form's budget in MiB (0: the term's CHUNK_BYTES)",
    )
    args = parser.parse_args(argv)
    rows = []
    for size in args.sizes:
        tokens = (size // args.patch) ** 2
        cases = [("plain", b) for b in args.plain_batch] + [("chunked", args.batch)]
        for mode, batch in cases:
            result = _run(mode, batch, tokens, args.dim, args.chunk_mib * 2**20)
            rows.append({"size": size, "tokens": tokens, "batch": batch, "mode": mode, **result})
    header = f"{'px':>5} {'tokens':>6} {'batch':>5} {'mode':>8} {'imgs/chunk':>10} {'matrix MB':>9} {'peak MB':>8} {'s':>6}"
    print(header)
    for r in rows:
        matrix_mb = r["batch"] * r["tokens"] ** 2 * 4 / 2**20
        print(
            f"{r['size']:>5} {r['tokens']:>6} {r['batch']:>5} {r['mode']:>8} {r['images_per_chunk']:>10} "
            f"{matrix_mb:>9.0f} {r['peak_mb']:>8.0f} {r['seconds']:>6.1f}"
        )
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
    else:
        main()
