"""The linear-probe LightningModule: frozen backbone, one linear head per learning rate, cosine SGD."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAccuracy

from ssl_xcit.errors import UserError
from ssl_xcit.evaluation import backbone as eval_backbone
from ssl_xcit.evaluation.features import FeatureConfig, compute_features
from ssl_xcit.evaluation.report import format_linear_table

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


def _linear_head(dim: int, num_classes: int) -> nn.Linear:
    """DINO's LinearClassifier init: weight ~ N(0, 0.01), bias 0 (each head drawn in turn, so head i does not
    depend on how many heads follow it)."""
    head = nn.Linear(dim, num_classes)
    nn.init.normal_(head.weight, mean=0.0, std=0.01)
    nn.init.zeros_(head.bias)
    return head


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
            raise UserError(f"lrs must be positive numbers, got {lrs!r}")
        self.config = FeatureConfig(n_last_blocks, avgpool_patchtokens)
        if feature_dim is None:
            self.backbone = eval_backbone.build_eval_backbone(weights, arch, seed)
            self.feature_dim = self.config.dim(self.backbone)
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
            raise UserError(f"a linear probe needs at least 2 classes, got {num_classes}")
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
            self.backbone.eval()  # frozen: a user's probe.train() must not enable drop-path or BN updates
        return self

    def on_train_epoch_start(self) -> None:
        # Lightning never calls train()/eval() on the module during fit, so a backbone left in train mode by
        # the caller would train with drop path and update BatchNorm statistics; set the mode here.
        if self.backbone is not None:
            self.backbone.eval()

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
