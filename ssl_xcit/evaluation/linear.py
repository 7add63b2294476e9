"""Linear probe on a frozen backbone, following DINO's ``eval_linear.py``, as a LightningModule.

- The backbone is frozen: no gradients, and always in eval mode (``train()`` is overridden, because Lightning
  calls ``model.train()`` at the start of every training epoch and would otherwise switch the backbone's
  dropout/drop-path/BatchNorm back on).
- The head is ``Linear(dim, num_classes)`` with weight ~ N(0, 0.01) and bias 0, on the CLS embedding; the
  feature can instead concatenate the CLS of the last n blocks and the average-pooled patch tokens.
- SGD, momentum 0.9, weight decay 0, lr = base_lr x total_batch / 256, cosine decay to 0 (per step here; DINO
  steps per epoch, which is the same curve sampled coarser).
- Train transform RandomResizedCrop + horizontal flip; validation uses the eval transform (resize, centre crop).
- ``lrs`` may list several base learning rates: one head per lr is trained on the same feature batches
  (DINOv2's sweep), which costs one backbone forward per batch in total, and the best head is reported.

``fast`` mode (``run_linear(..., fast=True)``) trains the heads on cached eval-transform features instead of
images: no augmentation, so usually slightly lower accuracy, but each epoch is a matmul and the features are
shared with the k-NN cache.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from ssl_xcit.evaluation import features as features_module
from ssl_xcit.evaluation.features import (
    FeatureConfig,
    check_not_empty,
    check_same_classes,
    compute_features,
)
from ssl_xcit.evaluation.report import format_linear_table

log = logging.getLogger(__name__)

# DINO's eval_linear.py default base lr (for a total batch of 256).
DEFAULT_BASE_LR = 0.001
# DINOv2's linear-eval sweep (base lrs for a total batch of 256): heads are cheap, so try them all at once.
DEFAULT_SWEEP_LRS: tuple[float, ...] = (
    1e-5,
    2e-5,
    5e-5,
    1e-4,
    2e-4,
    5e-4,
    1e-3,
    2e-3,
    5e-3,
    1e-2,
    2e-2,
    5e-2,
    0.1,
)


def linear_train_transform(crop_size: int = 224):
    """DINO's linear-probe train augmentation: RandomResizedCrop (bilinear, scale 0.08-1) + flip + normalise."""
    from torchvision.transforms import v2

    from ssl_xcit.data.transforms import IMAGENET_MEAN, IMAGENET_STD

    return v2.Compose(
        [
            v2.ToImage(),
            v2.RandomResizedCrop(crop_size, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=list(IMAGENET_MEAN), std=list(IMAGENET_STD)),
        ]
    )


def _eval_transform(resize_size: int, crop_size: int):
    from ssl_xcit.data.transforms import eval_transform

    return eval_transform(resize=resize_size, crop=crop_size)


def _linear_head(dim: int, num_classes: int) -> nn.Linear:
    """DINO's LinearClassifier init: weight ~ N(0, 0.01), bias 0 (each head drawn in turn, so head i does not
    depend on how many heads follow it)."""
    head = nn.Linear(dim, num_classes)
    nn.init.normal_(head.weight, mean=0.0, std=0.01)
    nn.init.zeros_(head.bias)
    return head


class LinearProbeDataModule(pl.LightningDataModule):
    """ImageFolder train/val trees (ImageNet's ``train/`` and ``val/`` class-folder layout works as is).

    Args:
        train: root of the labelled train images (one subfolder per class).
        val: root of the labelled validation images (the same class subfolders).
        batch_size: per device; the probe scales its lr by the total batch / 256.
        num_workers: data-loading processes per device.
        crop_size: training crop and validation centre crop (224 as in DINO).
        resize_size: validation resize before the centre crop (256 as in DINO, i.e. crop / 0.875).
    """

    def __init__(
        self,
        train: str,
        val: str,
        batch_size: int = 128,
        num_workers: int = 8,
        crop_size: int = 224,
        resize_size: int = 256,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_root, self.val_root = train, val
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.crop_size, self.resize_size = crop_size, resize_size
        self.train_dataset = self.val_dataset = None

    def _build(self) -> None:
        if self.train_dataset is not None:
            return
        from ssl_xcit.data.datasets import build_dataset

        self.train_dataset = build_dataset(self.train_root, transform=linear_train_transform(self.crop_size))
        self.val_dataset = build_dataset(
            self.val_root, transform=_eval_transform(self.resize_size, self.crop_size)
        )
        check_not_empty(self.train_dataset, "train", self.train_root)
        check_not_empty(self.val_dataset, "val", self.val_root)
        check_same_classes(self.train_dataset.classes, self.val_dataset.classes)

    def setup(self, stage: str | None = None) -> None:
        self._build()

    @property
    def num_classes(self) -> int:
        self._build()
        return len(self.train_dataset.classes)

    def _loader(self, dataset, shuffle: bool) -> DataLoader:
        from ssl_xcit.data.datasets import collate_skip_none

        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=False,
            num_workers=self.num_workers,
            collate_fn=collate_skip_none,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, shuffle=False)


class LinearProbe(pl.LightningModule):
    """Linear classifier(s) on a frozen backbone's features; one head per learning rate in ``lrs``.

    Args:
        weights: checkpoint of the backbone (any layout ``build_backbone`` accepts). Omit it with ``arch`` to probe
            a randomly initialised backbone, the baseline every pretrained number should beat.
        arch: registered backbone name; inferred from the checkpoint when omitted.
        num_classes: taken from the datamodule when omitted.
        n_last_blocks: concatenate the CLS embeddings of the last n blocks (1 = the final CLS, DINO's XCiT choice).
        avgpool_patchtokens: append the average-pooled patch tokens (DINO's ViT-B choice).
        lrs: base learning rate(s) for a total batch of 256 (DINO: 0.001); several train several heads at once.
        momentum: SGD momentum (DINO: 0.9).
        weight_decay: DINO uses 0: the probe is convex and weight decay only slows it down.
        per_device_batch_size: batch for the lr scaling when the datamodule has no ``batch_size`` (fast mode).
        feature_dim: train on precomputed features of this size (fast mode): no backbone is built.
        output: JSON file for the final results (default: ``<log_dir>/linear_results.json``).
        seed: seed of a randomly initialised backbone.
    """

    def __init__(
        self,
        weights: str | None = None,
        arch: str | None = None,
        num_classes: int | None = None,
        n_last_blocks: int = 1,
        avgpool_patchtokens: bool = False,
        lrs: float | list[float] = DEFAULT_BASE_LR,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        per_device_batch_size: int | None = None,
        feature_dim: int | None = None,
        output: str | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.base_lrs = [float(x) for x in ([lrs] if isinstance(lrs, (int, float)) else lrs)]
        if not self.base_lrs or any(not (math.isfinite(x) and x > 0) for x in self.base_lrs):
            raise ValueError(f"lrs must be positive numbers, got {lrs!r}")
        self.config = FeatureConfig(n_last_blocks, avgpool_patchtokens)
        if feature_dim is None:
            self.backbone = features_module.build_eval_backbone(weights, arch, seed)
            self.feature_dim = self.config.dim(self.backbone.embed_dim)
        else:
            self.backbone = None
            self.feature_dim = int(feature_dim)
        self.heads: nn.ModuleList | None = None
        self.val_top1: nn.ModuleList | None = None
        self.val_top5: nn.ModuleList | None = None
        if num_classes is not None:
            self._make_heads(num_classes)
        self.results: dict[str, Any] | None = None
        self.write_on_fit_end = (
            True  # the LightningCLI route writes JSON + prints the table at the end of fit
        )

    # --- model ---------------------------------------------------------------------------------------------
    def _make_heads(self, num_classes: int) -> None:
        if num_classes < 2:
            raise ValueError(f"a linear probe needs at least 2 classes, got {num_classes}")
        self.num_classes = num_classes
        self.hparams.num_classes = (
            num_classes  # saved in checkpoints, so load_from_checkpoint rebuilds the heads
        )
        self.heads = nn.ModuleList(_linear_head(self.feature_dim, num_classes) for _ in self.base_lrs)
        top5 = min(5, num_classes)
        self.val_top1 = nn.ModuleList(
            MulticlassAccuracy(num_classes, top_k=1, average="micro") for _ in self.heads
        )
        self.val_top5 = nn.ModuleList(
            MulticlassAccuracy(num_classes, top_k=top5, average="micro") for _ in self.heads
        )

    def configure_model(self) -> None:
        if self.heads is None:
            datamodule = getattr(self.trainer, "datamodule", None)
            if datamodule is None or not hasattr(datamodule, "num_classes"):
                raise ValueError(
                    "num_classes is unknown: pass num_classes or use a datamodule with .num_classes"
                )
            self._make_heads(int(datamodule.num_classes))

    def train(self, mode: bool = True) -> LinearProbe:
        super().train(mode)
        if self.backbone is not None:
            self.backbone.eval()  # frozen: Lightning's model.train() must not enable drop-path or BN updates
        return self

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if self.backbone is None:
            return x.float()
        with torch.no_grad():
            return compute_features(self.backbone, x, self.config).float()

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Logits of every head."""
        feats = self.features(x).flatten(1)
        return [head(feats) for head in self.heads]

    # --- steps -----------------------------------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        if batch is None:
            return None
        x, y = batch[0], batch[1]
        losses = [F.cross_entropy(logits, y) for logits in self(x)]
        # Heads are independent, so the gradient of the sum is each head's own gradient.
        loss = torch.stack(losses).sum()
        self.log("train/loss", loss.detach() / len(losses), prog_bar=True, batch_size=y.shape[0])
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"], batch_size=y.shape[0])
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch is None:
            return
        x, y = batch[0], batch[1]
        for i, logits in enumerate(self(x)):
            self.val_top1[i].update(logits, y)
            self.val_top5[i].update(logits, y)

    def on_validation_epoch_end(self) -> None:
        rows = []
        for i, base_lr in enumerate(self.base_lrs):
            top1 = round(100.0 * float(self.val_top1[i].compute()), 4)
            top5 = round(100.0 * float(self.val_top5[i].compute()), 4)
            self.val_top1[i].reset()
            self.val_top5[i].reset()
            rows.append({"base_lr": base_lr, "lr": base_lr * self._lr_scale(), "top1": top1, "top5": top5})
            if len(self.base_lrs) > 1:
                self.log(f"val/top1_lr{base_lr:g}", top1, sync_dist=False)
        best = max(rows, key=lambda r: r["top1"])
        self.log("val/top1", best["top1"], prog_bar=True)
        self.log("val/top5", best["top5"])
        self.results = {"per_lr": rows, "best": best, "epoch": int(self.current_epoch)}

    # --- optimisation ----------------------------------------------------------------------------------------
    def _lr_scale(self) -> float:
        """total batch / 256 (DINO's linear scaling rule)."""
        trainer = getattr(self, "_trainer", None)
        if trainer is None:
            return 1.0
        datamodule = getattr(trainer, "datamodule", None)
        per_device = getattr(datamodule, "batch_size", None) or self.hparams.per_device_batch_size
        if per_device is None:
            loader = getattr(trainer, "train_dataloader", None)
            per_device = getattr(loader, "batch_size", None) if loader is not None else None
        if per_device is None:
            raise ValueError(
                "cannot scale the lr: pass per_device_batch_size to LinearProbe or use a datamodule with batch_size"
            )
        return per_device * trainer.world_size * trainer.accumulate_grad_batches / 256

    def configure_optimizers(self):
        scale = self._lr_scale()
        groups = [
            {"params": head.parameters(), "lr": base_lr * scale}
            for head, base_lr in zip(self.heads, self.base_lrs, strict=True)
        ]
        optimizer = torch.optim.SGD(
            groups, momentum=self.hparams.momentum, weight_decay=self.hparams.weight_decay
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))

        def cosine(step: int) -> float:
            return 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def state_dict(self, *args, **kwargs):
        # The frozen backbone is re-created from `weights` on load; checkpoints keep only the heads.
        state = super().state_dict(*args, **kwargs)
        return {k: v for k, v in state.items() if not k.startswith("backbone.")}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if self.backbone is not None:
            state_dict = {**{f"backbone.{k}": v for k, v in self.backbone.state_dict().items()}, **state_dict}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def on_fit_end(self) -> None:
        if self.results is None or not self.write_on_fit_end or not self.trainer.is_global_zero:
            return
        results = self.describe()
        path = (
            self.hparams.output
            or Path(self.trainer.log_dir or self.trainer.default_root_dir) / "linear_results.json"
        )
        write_results(results, path)
        print(format_linear_table(results))

    def describe(self) -> dict[str, Any]:
        """The results dict written to JSON: accuracies, best lr, and everything that produced them."""
        from ssl_xcit.evaluation.cache import checkpoint_fingerprint

        weights = self.hparams.weights
        return {
            "protocol": "linear",
            "weights": weights,
            "checkpoint_sha256": checkpoint_fingerprint(weights) if weights else None,
            "arch": self.hparams.arch,
            "feature": self.config.name,
            "feature_dim": self.feature_dim,
            "num_classes": self.num_classes,
            "epochs": int(self.trainer.max_epochs) if self.trainer.max_epochs is not None else None,
            "total_batch_size": int(round(self._lr_scale() * 256)),
            "momentum": self.hparams.momentum,
            "weight_decay": self.hparams.weight_decay,
            "schedule": "cosine per step to 0",
            **(self.results or {}),
        }


def write_results(results: dict[str, Any], path: str | os.PathLike) -> Path:
    from ssl_xcit.utils.io import atomic_write_json

    return atomic_write_json(results, path)


def run_linear(
    train: str,
    val: str,
    *,
    weights: str | None = None,
    arch: str | None = None,
    fast: bool = False,
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
    """Train and validate the probe, write JSON results, return them. ``fast`` trains on cached features."""
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
    if fast:
        results = _run_fast(
            train,
            val,
            weights=weights,
            arch=arch,
            lrs=lrs,
            batch_size=batch_size,
            num_workers=num_workers,
            n_last_blocks=n_last_blocks,
            avgpool_patchtokens=avgpool_patchtokens,
            crop_size=crop_size,
            resize_size=resize_size,
            cache_dir=cache_dir,
            use_cache=use_cache,
            seed=seed,
            trainer_kwargs=trainer_kwargs,
        )
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


def _run_fast(
    train,
    val,
    *,
    weights,
    arch,
    lrs,
    batch_size,
    num_workers,
    n_last_blocks,
    avgpool_patchtokens,
    crop_size,
    resize_size,
    cache_dir,
    use_cache,
    seed,
    trainer_kwargs,
) -> dict[str, Any]:
    from ssl_xcit.data.datasets import build_dataset

    transform = _eval_transform(resize_size, crop_size)
    train_ds = build_dataset(train, transform=transform)
    val_ds = build_dataset(val, transform=transform)
    check_same_classes(train_ds.classes, val_ds.classes)
    (tr, tr_hit), (va, va_hit), _ = features_module.split_features(
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
        progress=trainer_kwargs["enable_progress_bar"],
    )
    model = LinearProbe(
        num_classes=len(train_ds.classes),
        feature_dim=tr["features"].shape[1],
        lrs=list(lrs),
        per_device_batch_size=batch_size,
        weights=weights,
        arch=arch,
        n_last_blocks=n_last_blocks,
        avgpool_patchtokens=avgpool_patchtokens,
    )
    model.write_on_fit_end = False
    g = torch.Generator().manual_seed(seed)
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
