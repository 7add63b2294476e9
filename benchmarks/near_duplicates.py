"""Dense quality: near-duplicate retrieval with VLAD and ASMK over patch tokens, models side by side.

    python benchmarks/near_duplicates.py build --out runs/near_dup                 # from flowers5's held-out 20 %
    python benchmarks/near_duplicates.py run --benchmark runs/near_dup/benchmark.json \\
        --weights dino=runs/dino_flowers5.pth --weights ibot=runs/ibot_flowers5.pth --random-init
    python benchmarks/near_duplicates.py build --out /tmp/nd --queries 4 --limit 12 \\
        && python benchmarks/near_duplicates.py run --benchmark /tmp/nd/benchmark.json --methods cls vlad \
        --random-init --arch xcit_nano_12_p8 --depth 1 --vlad-k 8 --max-train-images 8 --resolution 64

``build`` takes photos nobody trained on: by default the held-out 20 % of ``../shared/data/flowers5`` (the split of
``benchmarks/learning.py --data flowers5``; any ImageFolder path works, split the same way), or with ``--source
cifar10`` the 2,000 test photos of ``cifar10_12k`` (32 px; ``learning.py --data cifar10`` never trains on them). The database is
every held-out photo; each query is a transformed copy of one of them: a crop keeping 40-80 % of the area,
a rotation of 8-30 degrees either way, brightness, contrast and saturation x0.6-1.4 with a hue shift of up to
0.05, and JPEG re-encoding at quality 20-50. Its single positive is its source; the other held-out photos, many
of the same flower species, are distractors. The benchmark is written in the retrieval ``json`` format
(``ssl-xcit retrieval --dataset json``), with ``train_images.txt`` (the training split) for PCA and codebooks.

``run`` evaluates each ``--weights name=path`` (a backbone state dict or checkpoint; ``--random-init`` adds the
first one's architecture, or ``--arch``/``--depth``, at random initialisation) with each method, and prints mAP
and mP@1 side by side.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("SSL_XCIT_SHARED_DATA", REPO.parent / "shared" / "data"))

from ssl_xcit.data.datasets import build_dataset  # noqa: E402
from ssl_xcit.data.splits import stratified_split  # noqa: E402


def transformed_copy(image: Image.Image, rng: np.random.Generator) -> tuple[Image.Image, int, dict]:
    """A near-duplicate of ``image``: crop, rotation, colour change; returns (image, JPEG quality, record)."""
    image = image.convert("RGB")
    w, h = image.size
    area = rng.uniform(0.4, 0.8) * w * h
    aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
    cw = min(w, max(16, round(math.sqrt(area * aspect))))
    ch = min(h, max(16, round(math.sqrt(area / aspect))))
    left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    angle = float(rng.uniform(8, 30) * rng.choice([-1, 1]))
    factors = rng.uniform(0.6, 1.4, size=3)
    hue = float(rng.uniform(-0.05, 0.05))
    out = image.crop((left, top, left + cw, top + ch))
    out = F.rotate(out, angle)
    out = F.adjust_brightness(out, float(factors[0]))
    out = F.adjust_contrast(out, float(factors[1]))
    out = F.adjust_saturation(out, float(factors[2]))
    out = F.adjust_hue(out, hue)
    quality = int(rng.integers(20, 51))
    record = {"crop": [left, top, cw, ch], "angle": round(angle, 2), "colour": factors.round(3).tolist(),
              "hue": round(hue, 3), "jpeg_quality": quality}  # fmt: skip
    return out, quality, record


def hard_copy(image: Image.Image, rng: np.random.Generator) -> tuple[Image.Image, int, dict]:
    """The ``hard`` preset: a partial view (35-65 % of each side), a rotation of up to 20 degrees, a rescale of
    0.5-1.5x, a colour change, grayscale one time in five, JPEG quality 40-75."""
    image = image.convert("RGB")
    w, h = image.size
    cw = max(8, round(w * rng.uniform(0.35, 0.65)))
    ch = max(8, round(h * rng.uniform(0.35, 0.65)))
    left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    angle = float(rng.uniform(-20, 20))
    scale = float(rng.uniform(0.5, 1.5))
    factors = rng.uniform(0.6, 1.4, size=3)
    hue = float(rng.uniform(-0.1, 0.1))
    gray = bool(rng.random() < 0.2)
    out = F.rotate(image.crop((left, top, left + cw, top + ch)), angle)
    out = out.resize((max(8, round(cw * scale)), max(8, round(ch * scale))), Image.BICUBIC)
    out = F.adjust_brightness(out, float(factors[0]))
    out = F.adjust_contrast(out, float(factors[1]))
    out = F.adjust_saturation(out, float(factors[2]))
    out = F.adjust_hue(out, hue)
    if gray:
        out = out.convert("L").convert("RGB")
    quality = int(rng.integers(40, 76))
    record = {"crop": [left, top, cw, ch], "angle": round(angle, 2), "scale": round(scale, 3),
              "colour": factors.round(3).tolist(), "hue": round(hue, 3), "grayscale": gray,
              "jpeg_quality": quality}  # fmt: skip
    return out, quality, record


PRESETS = {"standard": transformed_copy, "hard": hard_copy}


def build(
    source: str,
    out: Path,
    n_queries: int,
    seed: int,
    limit: int | None,
    preset: str = "standard",
    held_out_all: bool = False,
    train_images: str | None = None,
) -> Path:
    """Write ``benchmark.json`` (database, queries, positives), the queries and ``train_images.txt``.

    ``held_out_all``: every photo of ``source`` is held out (for models trained on other data, whose training
    images ``train_images`` names: a folder or list, used for PCA and codebooks)."""
    if source == "cifar10":  # learning.py --data cifar10 trains on train/ and holds out all of test/
        train = build_dataset(str(SHARED / "cifar10_12k" / "train")).samples
        held_out = build_dataset(str(SHARED / "cifar10_12k" / "test")).samples
    else:
        root = SHARED / "flowers5" if source == "flowers5" else Path(source)
        samples = build_dataset(str(root)).samples
        train, held_out = stratified_split(samples, 0.2, 0)  # learning.py's split: never trained on
        if held_out_all:
            held_out = samples
    if train_images is not None:
        train = build_dataset(train_images).samples
    elif held_out_all:
        raise SystemExit("--held-out all needs --train-images (the images the models were trained on)")
    if limit:
        held_out = held_out[:limit]
    database = [str(Path(p).resolve()) for p, _ in held_out]
    rng = np.random.default_rng(seed)
    chosen = sorted(rng.choice(len(database), size=min(n_queries, len(database)), replace=False).tolist())
    (out / "queries").mkdir(parents=True, exist_ok=True)
    queries, positives, records = [], [], []
    for i, index in enumerate(chosen):
        with Image.open(database[index]) as image:
            copy, quality, record = PRESETS[preset](image, rng)
        name = f"queries/q{i:04d}.jpg"
        buffer = io.BytesIO()
        copy.save(buffer, "JPEG", quality=quality)  # the JPEG re-encoding is part of the transformation
        (out / name).write_bytes(buffer.getvalue())
        queries.append(name)
        positives.append([index])
        records.append({"query": name, "source": index, **record})
    spec = {"database": database, "queries": queries, "positives": positives, "transforms": records,
            "preset": preset}  # fmt: skip
    (out / "benchmark.json").write_text(json.dumps(spec, indent=1))
    (out / "train_images.txt").write_text("".join(f"{Path(p).resolve()}\n" for p, _ in train))
    print(f"{out / 'benchmark.json'}: {len(database)} database photos, {len(queries)} transformed queries")
    return out / "benchmark.json"


def _random_init(like: torch.nn.Module | None, arch: str | None, depth: int | None) -> torch.nn.Module:
    from ssl_xcit.models import create_model

    if like is not None:
        arch, depth = like.name, getattr(like, "depth", None)
    if arch is None:
        raise SystemExit("--random-init needs a --weights entry or --arch to know the architecture")
    torch.manual_seed(0)
    return create_model(arch, **({"depth": depth} if depth else {}))


def run(args: argparse.Namespace) -> list[dict]:
    from ssl_xcit.models import build_backbone
    from ssl_xcit.retrieval.config import RetrievalConfig
    from ssl_xcit.retrieval.pipeline import run_retrieval

    if args.threads:
        torch.set_num_threads(args.threads)
    models = []
    for item in args.weights:
        name, _, path = item.partition("=")
        models.append((name, path, build_backbone(path)))
    if args.random_init:
        like = models[0][2] if models else None
        models.append(("random init", None, _random_init(like, args.arch, args.depth)))
    train_list = args.train_images or str(Path(args.benchmark).parent / "train_images.txt")
    rows = []
    jobs = [(m, t) for m in args.methods for t in (["last_block"] if m == "cls" else args.local_tokens)]
    for name, path, model in models:
        for method, tokens in jobs:
            config = RetrievalConfig(
                dataset="json",
                data_root=args.benchmark,
                method=method,
                weights=path,
                resolution=args.resolution,
                train_images=None if method == "cls" else train_list,
                max_train_images=args.max_train_images,
                codebook_size={"vlad": args.vlad_k, "asmk": args.asmk_k}.get(method),
                no_cache=True,
                seed=args.seed,
                local_tokens=tokens,
            )
            start = time.perf_counter()
            result = run_retrieval(config, model=model)
            metrics = result["metrics"]
            row = {"model": name, "method": method, "tokens": tokens, "k": config.codebook_size, "resolution": args.resolution,
                   "mAP": 100 * metrics["mAP"], "mP@1": 100 * metrics["mP@1"],
                   "minutes": round((time.perf_counter() - start) / 60, 2)}  # fmt: skip
            rows.append(row)
            print(f"RESULT {name:12s} {method:5s} {tokens:10s} k={row['k']} {args.resolution}px  mAP {row['mAP']:.2f}  "
                  f"mP@1 {row['mP@1']:.2f}  ({row['minutes']} min)", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps({**row, "benchmark": args.benchmark}) + "\n")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write the benchmark (queries + benchmark.json + train_images.txt)")
    b.add_argument(
        "--source",
        default="flowers5",
        help="flowers5, cifar10 (its test/) or an ImageFolder path (held-out 20 %%)",
    )
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--queries", type=int, default=200)
    b.add_argument("--limit", type=int, default=None, help="keep only the first N held-out photos (tests)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="standard",
        help="standard: 40-80 %% crops, 8-30 degrees, JPEG 20-50; hard: 35-65 %% of each side, up to 20 degrees, "
        "0.5-1.5x, 20 %% grayscale, JPEG 40-75",
    )
    b.add_argument(
        "--held-out",
        choices=("split", "all"),
        default="split",
        help="split: the held-out 20 %% of the source; all: every source photo (models trained elsewhere)",
    )
    b.add_argument("--train-images", default=None, help="the models' training images (with --held-out all)")
    r = sub.add_parser("run", help="evaluate models on a built benchmark")
    r.add_argument("--benchmark", required=True)
    r.add_argument("--weights", action="append", default=[], metavar="NAME=PATH")
    r.add_argument("--random-init", action="store_true", help="add the first model's architecture, untrained")
    r.add_argument("--arch", default=None, help="--random-init's architecture when no --weights is given")
    r.add_argument("--depth", type=int, default=None, help="with --arch: blocks kept")
    r.add_argument("--methods", nargs="+", default=["cls", "vlad", "asmk"], choices=["cls", "vlad", "asmk"])
    r.add_argument(
        "--resolution", type=int, default=128, help="longer side in px (flowers5 photos are 128x128)"
    )
    r.add_argument("--train-images", default=None, help="default: train_images.txt beside the benchmark")
    r.add_argument("--max-train-images", type=int, default=500)
    r.add_argument(
        "--local-tokens",
        nargs="+",
        default=["last_block"],
        choices=["last_block", "final_norm"],
        help="VLAD/ASMK patch tokens: each choice is a row (ssl-xcit retrieval --local-tokens)",
    )
    # Fewer clusters than the paper's ImageNet-scale 256 / 1,024 default would be tuned to this small benchmark;
    # the defaults are kept.
    r.add_argument("--vlad-k", type=int, default=256)
    r.add_argument("--asmk-k", type=int, default=1024)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--threads", type=int, default=0)
    r.add_argument("--json", default=None, help="append the rows to this JSON-lines file")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    if args.command == "build":
        build(
            args.source,
            args.out,
            args.queries,
            args.seed,
            args.limit,
            args.preset,
            args.held_out == "all",
            args.train_images,
        )
    else:
        run(args)
