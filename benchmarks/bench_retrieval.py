"""Retrieval speed and memory: descriptor extraction at 768 px, VLAD encoding and ASMK indexing at ROxford scale.

    python benchmarks/bench_retrieval.py            # full sizes (~8-9 min on 2 shared CPU cores)
    python benchmarks/bench_retrieval.py --quick    # 1,000 database images x 200 descriptors (~1-2 min)

Part 1 (real photos from ../shared/data/retrieval_mini, random XCiT-S12/16 weights: speed is the point):
  * decoding a 3264x2448 Holidays JPEG for 768 px with PIL ``draft`` vs a full decode (median, ratio);
  * CLS and patch-token extraction images/s at 768 px (768x576 inputs = 1,728 tokens), with 1 and 2 torch
    threads side by side, and on the GPU when one is present.
Part 2 (synthetic 128-d local descriptors, ROxford scale: 4,993 database + 70 query images, --n-local per image,
clustered like real descriptors: each image draws from 40 of 8,192 modes):
  * faiss k-means codebook time for each k;
  * VLAD encoding time (images/s), its float16 matrix size, and the 70-query cosine search;
  * ASMK (binary, alpha 3, tau 0, MA 5/1) inverted-file build time and per-query time.
Peak memory is the process's resident-set high-water mark during each step (``VmHWM``, reset before the step
through ``/proc/self/clear_refs``; where that is unavailable, the process peak so far).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ssl_xcit.models import create_model  # noqa: E402
from ssl_xcit.retrieval.asmk_index import AsmkIndex  # noqa: E402
from ssl_xcit.retrieval.datasets import load_resized, to_tensor  # noqa: E402
from ssl_xcit.retrieval.descriptors import select_local  # noqa: E402
from ssl_xcit.retrieval.pipeline import rank  # noqa: E402
from ssl_xcit.retrieval.vlad import train_codebook, vlad_batch  # noqa: E402


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def peak_mb() -> float:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(fn, repeats: int = 1):
    """(median seconds, last result, peak resident MB during the calls)."""
    reset_peak()
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out, peak_mb()


def bench_extraction(data: Path, n_images: int, repeats: int) -> None:
    mini = data / "retrieval_mini"
    paths = sorted((mini / "holidays").glob("*.jpg")) + sorted((mini / "ukbench").glob("*.jpg"))
    paths = paths[:n_images]
    if not paths:
        print(f"[extraction] skipped: no images under {mini}")
        return
    from PIL import Image

    def full_decode(p):
        with Image.open(p) as im:
            im = im.convert("RGB")
        s = 768 / max(im.size)
        return im.resize((round(im.width * s), round(im.height * s)), Image.Resampling.BICUBIC)

    holiday = paths[0]
    t_draft, _, _ = timed(lambda: load_resized(holiday, 768, 16), repeats=3)
    t_full, _, _ = timed(lambda: full_decode(holiday), repeats=3)
    print(
        f"[decode] {holiday.name} (3264x2448 JPEG) to 768 px: draft {1000 * t_draft:.0f} ms, full decode "
        f"{1000 * t_full:.0f} ms, ratio {t_full / t_draft:.1f}x"
    )

    model = create_model("xcit_small_12_p16").eval()
    xs = [to_tensor(load_resized(p, 768, 16))[None] for p in paths]
    print(
        f"[extract] XCiT-S12/16 (random weights), {len(xs)} real photos at 768 px, input sizes "
        f"{sorted({tuple(x.shape[-2:]) for x in xs})}, {repeats} repeats, median per image"
    )
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for threads in [1, 2] if device == "cpu" else [torch.get_num_threads()]:
            torch.set_num_threads(threads)
            model.to(device)
            for name, fn in (
                ("CLS", lambda x: model(x)),
                (
                    "patch tokens + top-1000",
                    lambda x: select_local(model.forward_patch_tokens(x)[0][0], 1000),
                ),
            ):
                with torch.inference_mode():
                    fn(xs[0].to(device))  # warm-up
                    per_image = []
                    reset_peak()
                    for _ in range(repeats):
                        for x in xs:
                            x = x.to(device)
                            if device == "cuda":
                                torch.cuda.synchronize()
                            t = time.perf_counter()
                            fn(x)
                            if device == "cuda":
                                torch.cuda.synchronize()
                            per_image.append(time.perf_counter() - t)
                med = statistics.median(per_image)
                print(
                    f"  {device:4s} threads={threads}  {name:24s} {med:6.3f} s/img  {1 / med:6.2f} img/s  "
                    f"peak RSS {peak_mb():.0f} MB"
                )
    torch.set_num_threads(1)


def synthetic_descriptors(n_images: int, n_local: int, d: int, modes: np.ndarray, rng) -> np.ndarray:
    out = np.empty((n_images * n_local, d), dtype=np.float16)
    for i in range(n_images):
        centres = modes[rng.integers(0, len(modes), 40)]
        x = centres[rng.integers(0, 40, n_local)] + 0.35 * rng.standard_normal((n_local, d)).astype(
            np.float32
        )
        out[i * n_local : (i + 1) * n_local] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def bench_aggregation(n_db: int, n_query: int, n_local: int, vlad_ks, asmk_k: int, d: int = 128) -> None:
    rng = np.random.default_rng(0)
    modes = rng.standard_normal((8192, d)).astype(np.float32)
    modes /= np.linalg.norm(modes, axis=1, keepdims=True)
    n_train = max(256 * max([*vlad_ks, asmk_k]), 50_000)
    train = synthetic_descriptors(n_train // n_local + 1, n_local, d, modes, rng)[:n_train].astype(np.float32)
    db = torch.from_numpy(synthetic_descriptors(n_db, n_local, d, modes, rng))
    q = torch.from_numpy(synthetic_descriptors(n_query, n_local, d, modes, rng))
    db_counts, q_counts = torch.full((n_db,), n_local), torch.full((n_query,), n_local)
    print(
        f"[synthetic] {n_db} database + {n_query} query images x {n_local} descriptors x {d}-d "
        f"(float16: {db.numel() * 2 / 2**20:.0f} MB), k-means on {n_train:,} training descriptors, 1 thread"
    )
    codebooks = {}
    for k in sorted({*vlad_ks, asmk_k}):
        t, codebooks[k], mem = timed(lambda k=k: train_codebook(train, k, niter=20, seed=0))
        print(f"  k-means k={k:5d} (20 iters):  {t:7.1f} s   peak RSS {mem:.0f} MB")
    for k in vlad_ks:
        t_db, vdb, mem = timed(lambda k=k: vlad_batch(db, db_counts, codebooks[k]))
        t_q, vq, _ = timed(lambda k=k: vlad_batch(q, q_counts, codebooks[k]))
        t_s, (ranks, _), mem_s = timed(lambda vq=vq, vdb=vdb: rank(vq, vdb))
        print(
            f"  VLAD k={k:5d}: encode {n_db} db {t_db:6.1f} s ({n_db / t_db:6.0f} img/s), {n_query} queries "
            f"{t_q:5.2f} s; matrix {vdb.numel() * 2 / 2**20:.0f} MB float16; search {t_s:5.2f} s; "
            f"peak RSS {max(mem, mem_s):.0f} MB"
        )
        del vdb, vq, ranks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        index = AsmkIndex(codebooks[asmk_k])
    from ssl_xcit.retrieval.descriptors import split_counts

    t_b, stats, mem_b = timed(lambda: index.build(split_counts(db, db_counts, 256)))
    t_q, (ranks, _), mem_q = timed(lambda: index.query(q.numpy(), q_counts.numpy()))
    print(
        f"  ASMK k={asmk_k:5d} (binary, MA 5/1): build {t_b:6.1f} s ({n_db / t_b:5.0f} img/s, "
        f"{stats['vectors_per_image']:.0f} words/img), query {t_q:5.1f} s = {1000 * t_q / n_query:.0f} ms/query; "
        f"peak RSS build {mem_b:.0f} MB, query {mem_q:.0f} MB"
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1,000 db images x 200 descriptors, 3 photos")
    p.add_argument("--n-db", type=int, default=4993)
    p.add_argument("--n-query", type=int, default=70)
    p.add_argument("--n-local", type=int, default=500)
    p.add_argument("--vlad-k", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--asmk-k", type=int, default=1024)
    p.add_argument("--extract-images", type=int, default=5)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--skip-extraction", action="store_true")
    p.add_argument("--skip-aggregation", action="store_true")
    p.add_argument(
        "--data", default=os.environ.get("SSL_XCIT_SHARED_DATA", str(REPO.parent / "shared" / "data"))
    )
    args = p.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # progress visible when redirected to a file
    if args.quick:  # smaller sizes, unless given explicitly
        for key, value in (("n_db", 1000), ("n_local", 200), ("extract_images", 3)):
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, GPU: "
        f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}"
    )
    t0 = time.perf_counter()
    if not args.skip_extraction:
        bench_extraction(Path(args.data), args.extract_images, args.repeats)
    if not args.skip_aggregation:
        bench_aggregation(args.n_db, args.n_query, args.n_local, args.vlad_k, args.asmk_k)
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
