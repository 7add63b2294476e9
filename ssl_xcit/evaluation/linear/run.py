"""``run_linear``: the linear probe end to end, on images (full) or on cached eval features (fast)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from ssl_xcit.errors import UserError
from ssl_xcit.evaluation import cached
from ssl_xcit.evaluation.checks import check_same_classes
from ssl_xcit.evaluation.features import FeatureConfig
from ssl_xcit.evaluation.linear.data import LinearProbeDataModule, _eval_transform
from ssl_xcit.evaluation.linear.probe import DEFAULT_BASE_LR, DEFAULT_SWEEP_LRS, LinearProbe, write_results

SOLVERS = ("sgd", "lbfgs")


def run_linear(
    train: str,
    val: str,
    *,
    weights: str | None = None,
    arch: str | None = None,
    fast: bool = False,
    solver: str = "sgd",
    lrs: Sequence[float] | None = None,
    epochs: int = 100,
    batch_size: int = 128,
    num_workers: int = 8,
    n_last_blocks: int = 1,
    avgpool_patchtokens: bool = False,
    crop_size: int = 224,
    resize_size: int = 256,
    cache_dir: str | None = None,
    use_cache: bool = True,
    output: str | None = None,
    default_root_dir: str | None = None,
    accelerator: str = "auto",
    devices: int | str = "auto",
    precision: str | None = None,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Train and validate the probe, write JSON results, return them. ``fast`` trains on cached features;
    ``solver="lbfgs"`` fits scikit-learn's logistic regression on them (:mod:`.lbfgs`) instead of SGD heads."""
    if solver not in SOLVERS:
        raise UserError(f"unknown solver {solver!r}; valid solvers: {', '.join(SOLVERS)}")
    if solver == "lbfgs" and lrs is not None:
        raise UserError("--lrs sets the SGD learning rates; --solver lbfgs sweeps C itself, so drop --lrs")
    pl.seed_everything(seed, workers=True, verbose=False)
    if lrs is None:
        lrs = DEFAULT_SWEEP_LRS if fast else (DEFAULT_BASE_LR,)
    trainer_kwargs = dict(
        max_epochs=epochs,
        accelerator=accelerator,
        devices=devices,
        precision=precision,
        default_root_dir=default_root_dir,
        enable_progress_bar=progress,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=not fast,
        num_sanity_val_steps=0,
        deterministic=False,
    )
    # What the cached-feature solvers extract with, and how (one set for both, passed through to _features).
    extract = dict(
        weights=weights,
        arch=arch,
        n_last_blocks=n_last_blocks,
        avgpool_patchtokens=avgpool_patchtokens,
        crop_size=crop_size,
        resize_size=resize_size,
        cache_dir=cache_dir,
        use_cache=use_cache,
        batch_size=batch_size,
        num_workers=num_workers,
        seed=seed,
        trainer_kwargs=trainer_kwargs,
    )
    if solver == "lbfgs":
        results = _run_lbfgs(train, val, **extract)
    elif fast:
        results = _run_fast(train, val, lrs=lrs, **extract)
    else:
        data = LinearProbeDataModule(train, val, batch_size, num_workers, crop_size, resize_size)
        model = LinearProbe(
            weights=weights,
            arch=arch,
            n_last_blocks=n_last_blocks,
            avgpool_patchtokens=avgpool_patchtokens,
            lrs=list(lrs),
            seed=seed,
        )
        model.write_on_fit_end = False  # run_linear writes the fuller results itself
        trainer = pl.Trainer(**trainer_kwargs)
        trainer.fit(model, datamodule=data)
        results = model.describe()
        results.update(
            mode="full",
            num_train=len(data.train_dataset),
            num_val=len(data.val_dataset),
            train_transform=repr(data.train_dataset.transform),
            val_transform=repr(data.val_dataset.transform),
        )
    results.update(train=str(train), val=str(val), seed=seed)
    if output:
        write_results(results, output)
    return results


def _run_fast(train, val, *, lrs, **extract) -> dict[str, Any]:
    train_ds, transform, (tr, tr_hit), (va, va_hit) = _features(train, val, **extract)
    batch_size, trainer_kwargs = extract["batch_size"], extract["trainer_kwargs"]
    model = LinearProbe(
        num_classes=len(train_ds.classes),
        feature_dim=tr["features"].shape[1],
        lrs=list(lrs),
        per_device_batch_size=batch_size,
        weights=extract["weights"],
        arch=extract["arch"],
        n_last_blocks=extract["n_last_blocks"],
        avgpool_patchtokens=extract["avgpool_patchtokens"],
    )
    model.write_on_fit_end = False
    g = torch.Generator().manual_seed(extract["seed"])
    train_loader = DataLoader(
        TensorDataset(tr["features"], tr["labels"]), batch_size=batch_size, shuffle=True, generator=g
    )
    val_loader = DataLoader(TensorDataset(va["features"], va["labels"]), batch_size=max(batch_size, 1024))
    # Heads on cached features are tiny: one process is faster than any multi-device launch.
    kwargs = {**trainer_kwargs, "devices": 1}
    trainer = pl.Trainer(**kwargs)
    trainer.fit(model, train_dataloaders=train_loader, val_dataloaders=val_loader)
    results = model.describe()
    results.update(
        mode="fast",
        num_train=int(tr["features"].shape[0]),
        num_val=int(va["features"].shape[0]),
        feature_cache_hit={"train": tr_hit, "val": va_hit},
        transform=repr(transform),
    )
    return results


def _features(
    train,
    val,
    *,
    weights,
    arch,
    n_last_blocks,
    avgpool_patchtokens,
    crop_size,
    resize_size,
    cache_dir,
    use_cache,
    batch_size,
    num_workers,
    seed,
    trainer_kwargs,
) -> tuple[Any, Any, tuple[dict[str, torch.Tensor], bool], tuple[dict[str, torch.Tensor], bool]]:
    """The cached eval-transform features of both splits (shared with ``ssl-xcit knn``):
    ``(train_dataset, transform, (train, hit), (val, hit))``."""
    from ssl_xcit.data.datasets import build_dataset

    transform = _eval_transform(resize_size, crop_size)
    train_ds = build_dataset(train, transform=transform)
    val_ds = build_dataset(val, transform=transform)
    check_same_classes(train_ds.classes, val_ds.classes)
    tr, va, _ = cached.split_features(
        train_ds,
        val_ds,
        weights=weights,
        arch=arch,
        config=FeatureConfig(n_last_blocks, avgpool_patchtokens),
        seed=seed,
        cache_dir=cache_dir,
        use_cache=use_cache,
        batch_size=batch_size,
        num_workers=num_workers,
        accelerator=trainer_kwargs["accelerator"],
        devices=trainer_kwargs["devices"],
        precision=trainer_kwargs["precision"],
        progress=trainer_kwargs["enable_progress_bar"],
    )
    return train_ds, transform, tr, va


def _run_lbfgs(train, val, **extract) -> dict[str, Any]:
    from ssl_xcit.evaluation.cache import checkpoint_fingerprint
    from ssl_xcit.evaluation.linear.lbfgs import lbfgs_probe

    train_ds, transform, (tr, tr_hit), (va, va_hit) = _features(train, val, **extract)
    weights, seed = extract["weights"], extract["seed"]
    paths = [str(train_ds.samples[i][0]) for i in tr["indices"].tolist()]
    results = lbfgs_probe(tr, va, paths, num_classes=len(train_ds.classes), seed=seed)
    return {
        "protocol": "linear",
        "mode": "lbfgs",
        "weights": weights,
        "checkpoint_sha256": checkpoint_fingerprint(weights) if weights else None,
        "arch": extract["arch"],
        "feature": FeatureConfig(extract["n_last_blocks"], extract["avgpool_patchtokens"]).name,
        **results,
        "num_train": int(tr["features"].shape[0]),
        "num_val": int(va["features"].shape[0]),
        "feature_cache_hit": {"train": tr_hit, "val": va_hit},
        "transform": repr(transform),
    }
