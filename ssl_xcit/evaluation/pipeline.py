"""End-to-end k-NN evaluation: image folders + checkpoint -> cached features -> weighted k-NN -> JSON + table."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from ssl_xcit.errors import UserError
from ssl_xcit.evaluation import cached
from ssl_xcit.evaluation.cache import checkpoint_fingerprint
from ssl_xcit.evaluation.checks import check_not_empty, check_same_classes
from ssl_xcit.evaluation.features import FeatureConfig
from ssl_xcit.evaluation.knn import BACKENDS, DEFAULT_KS, DEFAULT_TEMPERATURE, knn_accuracy
from ssl_xcit.evaluation.report import format_knn_table
from ssl_xcit.models.sharded import is_checkpoint


def _is_rank_zero() -> bool:
    from lightning.pytorch.utilities import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


def load_split_datasets(train: str | os.PathLike, val: str | os.PathLike, transform) -> tuple[Any, Any]:
    """Labelled train/val datasets with identical class sets (errors name the differing classes)."""
    from ssl_xcit.data.datasets import build_dataset

    train_ds = build_dataset(train, transform=transform)
    val_ds = build_dataset(val, transform=transform)
    check_not_empty(train_ds, "train", train)
    check_not_empty(val_ds, "val", val)
    check_same_classes(train_ds.classes, val_ds.classes)
    return train_ds, val_ds


def evaluate_knn(
    train: str | os.PathLike | Any,
    val: str | os.PathLike | Any,
    *,
    weights: str | os.PathLike | None = None,
    arch: str | None = None,
    ks: Sequence[int] = DEFAULT_KS,
    temperature: float = DEFAULT_TEMPERATURE,
    backend: str = "torch",
    batch_size: int = 128,
    num_workers: int = 8,
    resize_size: int = 256,
    crop_size: int = 224,
    n_last_blocks: int = 1,
    avgpool_patchtokens: bool = False,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    accelerator: str = "auto",
    devices: int | str = "auto",
    precision: str | None = None,
    knn_device: str = "auto",
    chunk_size: int | None = None,
    output: str | os.PathLike | None = None,
    seed: int = 0,
    progress: bool = True,
    print_table: bool = True,
) -> dict[str, Any]:
    """Weighted k-NN top-1/top-5 for every k of ``ks`` (DINO protocol); writes ``output`` JSON if given.

    ``train``/``val`` are image roots (ImageFolder trees) or already built labelled ``ImageDataset`` objects
    (their own transform is then used). Without ``weights``, ``arch`` is evaluated randomly initialised.
    """
    from ssl_xcit.data.transforms import eval_transform

    if backend not in BACKENDS:
        raise UserError(f"unknown k-NN backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    if weights is not None and not is_checkpoint(weights):
        raise FileNotFoundError(f"weights file not found: {weights}")
    if weights is None and arch is None:
        raise UserError("give --weights, or --arch NAME to evaluate a randomly initialised backbone")
    if isinstance(train, (str, os.PathLike)) or isinstance(val, (str, os.PathLike)):
        train_ds, val_ds = load_split_datasets(train, val, eval_transform(resize=resize_size, crop=crop_size))
    else:
        train_ds, val_ds = train, val
        check_not_empty(train_ds, "train")
        check_not_empty(val_ds, "val")
        check_same_classes(train_ds.classes, val_ds.classes)

    config = FeatureConfig(n_last_blocks, avgpool_patchtokens)
    t0 = time.perf_counter()
    (tr, tr_hit), (va, va_hit), backbone = cached.split_features(
        train_ds,
        val_ds,
        weights=weights,
        arch=arch,
        config=config,
        seed=seed,
        cache_dir=cache_dir,
        use_cache=use_cache,
        batch_size=batch_size,
        num_workers=num_workers,
        accelerator=accelerator,
        devices=devices,
        precision=precision,
        progress=progress,
    )
    t1 = time.perf_counter()

    device = knn_device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and backend == "torch" else "cpu"
    per_k = knn_accuracy(
        tr["features"].to(device),
        tr["labels"].to(device),
        va["features"].to(device),
        va["labels"],
        ks=ks,
        temperature=temperature,
        num_classes=len(train_ds.classes),
        backend=backend,
        chunk_size=chunk_size,
    )
    t2 = time.perf_counter()
    results = {
        "protocol": "knn",
        "weights": str(weights) if weights is not None else None,
        "checkpoint_sha256": checkpoint_fingerprint(weights),
        "arch": arch or (backbone.name if backbone is not None else "inferred from checkpoint"),
        "init": "pretrained" if weights is not None else f"random (seed {seed})",
        "feature": config.name,
        "transform": repr(getattr(train_ds, "transform", None)),
        "train": str(
            getattr(train_ds, "root", train if isinstance(train, (str, os.PathLike)) else "dataset")
        ),
        "val": str(getattr(val_ds, "root", val if isinstance(val, (str, os.PathLike)) else "dataset")),
        "num_train": int(tr["features"].shape[0]),
        "num_val": int(va["features"].shape[0]),
        "num_skipped": {
            "train": len(train_ds) - int(tr["features"].shape[0]),
            "val": len(val_ds) - int(va["features"].shape[0]),
        },
        "num_classes": len(train_ds.classes),
        "ks": [int(k) for k in ks],
        "temperature": float(temperature),
        "backend": backend,
        "results": {
            str(k): {key: row[key] for key in ("top1", "top5", "k", "k_effective")}
            for k, row in per_k.items()
        },
        "feature_cache_hit": {"train": tr_hit, "val": va_hit},
        "seconds": {"features": round(t1 - t0, 3), "knn": round(t2 - t1, 3)},
    }
    if _is_rank_zero():
        if output is not None:
            from ssl_xcit.utils.io import atomic_write_json

            atomic_write_json(results, output)
        if print_table:
            print(format_knn_table(results))
    return results
