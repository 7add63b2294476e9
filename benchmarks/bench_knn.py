"""k-NN search speed and peak memory, torch vs faiss backends, side by side on CPU.

ImageNet-sized by default: 50,000 queries against 1,281,167 synthetic 384-d features (XCiT-S12's width),
1000 classes, top-200 neighbours (k = 10, 20, 100, 200 reported from one search, as in the DINO protocol).

    python benchmarks/bench_knn.py                                   # full size (~2 GB bank; ~50 min on 2 cores)
    python benchmarks/bench_knn.py --n-train 100000 --n-query 5000  # quick look

Each backend runs in its own child process on identical data (same seed), so its peak RSS
(``resource.getrusage(...).ru_maxrss``) is its own; ``--repeats`` runs of each are interleaved and the median
search time is reported, with the ratio torch / faiss (> 1 means faiss is faster). The data generation
time and the bank's own size are reported separately: the bank alone is n_train x dim x 4 bytes.
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


def make_data(n_train: int, n_query: int, dim: int, num_classes: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    train = torch.randn(n_train, dim, generator=g)
    labels = torch.randint(0, num_classes, (n_train,), generator=g)
    # Queries are noisy copies of bank points, so the accuracies are far from chance and comparable.
    pick = torch.randint(0, n_train, (n_query,), generator=g)
    queries = train[pick] + 3.0 * torch.randn(n_query, dim, generator=g)
    return train, labels, queries, labels[pick]


def child(args: argparse.Namespace) -> None:
    import torch

    from ssl_xcit.evaluation.knn import faiss_threads, knn_accuracy

    t0 = time.perf_counter()
    train, labels, queries, qlabels = make_data(
        args.n_train, args.n_query, args.dim, args.num_classes, args.seed
    )
    t1 = time.perf_counter()
    base_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # imports + data, before the search
    acc = knn_accuracy(
        train,
        labels,
        queries,
        qlabels,
        ks=(10, 20, 100, 200),
        backend=args.backend,
        num_classes=args.num_classes,
    )
    t2 = time.perf_counter()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(
        json.dumps(
            {
                "backend": args.backend,
                "generate_s": t1 - t0,
                "search_s": t2 - t1,
                "peak_rss_gib": peak_kib / 2**20,
                "search_extra_gib": (peak_kib - base_kib) / 2**20,
                "top1": {k: v["top1"] for k, v in acc.items()},
                "torch_threads": torch.get_num_threads(),
                "faiss_threads": faiss_threads(),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--n-train", type=int, default=1_281_167, help="bank size (ImageNet train: 1,281,167)"
    )
    parser.add_argument("--n-query", type=int, default=50_000, help="queries (ImageNet val: 50,000)")
    parser.add_argument("--dim", type=int, default=384, help="feature width (XCiT-S12: 384)")
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=1, help="runs per backend (median reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("torch", "faiss"), help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args()
    if args.backend:
        child(args)
        return

    runs: dict[str, list[dict]] = {"torch": [], "faiss": []}
    base = [
        sys.executable,
        os.path.abspath(__file__),
        "--n-train",
        str(args.n_train),
        "--n-query",
        str(args.n_query),
        "--dim",
        str(args.dim),
        "--num-classes",
        str(args.num_classes),
        "--seed",
        str(args.seed),
    ]
    for _ in range(args.repeats):
        for backend in ("torch", "faiss"):  # interleaved, so drifting machine load hits both alike
            out = subprocess.run(
                [*base, "--backend", backend], check=True, capture_output=True, text=True
            ).stdout
            runs[backend].append(json.loads(out.strip().splitlines()[-1]))
            r = runs[backend][-1]
            print(
                f"  {backend:5s} search {r['search_s']:8.2f} s  peak RSS {r['peak_rss_gib']:.2f} GiB "
                f"(+{r['search_extra_gib']:.2f} GiB over imports + data)",
                flush=True,
            )

    bank_gib = args.n_train * args.dim * 4 / 2**30
    print(
        f"\nk-NN: {args.n_query:,} queries x {args.n_train:,} bank x {args.dim}-d, top-200, "
        f"{args.num_classes} classes (bank alone {bank_gib:.2f} GiB); median of {args.repeats}"
    )
    print(
        f"{'backend':8s} {'search s':>9s} {'peak RSS GiB':>13s} {'search +GiB':>12s} {'top1@20':>8s} {'threads':>8s}"
    )
    med = {}
    for backend, rs in runs.items():
        med[backend] = statistics.median(r["search_s"] for r in rs)
        peak = max(r["peak_rss_gib"] for r in rs)
        extra = max(r["search_extra_gib"] for r in rs)
        threads = rs[0]["torch_threads"] if backend == "torch" else rs[0]["faiss_threads"]
        print(
            f"{backend:8s} {med[backend]:9.2f} {peak:13.2f} {extra:12.2f} {rs[0]['top1']['20']:8.2f} {threads:8d}"
        )
    print(f"ratio torch / faiss search time: {med['torch'] / med['faiss']:.2f}x")
    same = runs["torch"][0]["top1"] == runs["faiss"][0]["top1"]
    print(f"identical top-1 for every k: {same}")


if __name__ == "__main__":
    main()
