"""Frozen-feature extraction from any backbone, batched and distributed.

``extract_features(model, dataset)`` runs a tiny LightningModule through ``Trainer.predict``: Lightning shards the
dataset over the GPUs (an unrepeated distributed sampler, so no image is counted twice), each rank returns
``(features, labels, indices)``, and the ranks' results are all-gathered and put back in dataset order by
index. Corrupt images come back as ``None`` from the dataset and are dropped by the collate function, so they
are simply absent from ``indices``: features and labels stay aligned. On CPU it is one process.

The same features through the on-disk cache: :func:`ssl_xcit.evaluation.cached.dataset_features` (key in
:mod:`ssl_xcit.evaluation.keys`, backbone from :mod:`ssl_xcit.evaluation.backbone`, dataset checks in
:mod:`ssl_xcit.evaluation.checks`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

from ssl_xcit.errors import UserError
from ssl_xcit.evaluation.checks import check_not_empty

__all__ = [
    "FeatureConfig",
    "FeatureExtractor",
    "compute_features",
    "extract_features",
    "run_extraction",
]


@dataclass(frozen=True)
class FeatureConfig:
    """Which frozen feature to take from the backbone.

    ``n_last_blocks=1, avgpool_patchtokens=False`` is the final normed CLS embedding, i.e. ``model(x)``: what DINO
    uses for XCiT in both k-NN and linear evaluation. ``n_last_blocks=n`` concatenates the CLS embeddings
    computed from the last n XCA blocks (DINO's ViT-S linear recipe uses 4); ``avgpool_patchtokens`` appends
    the mean of the backbone's dense tokens (``forward_patch_tokens``: the final normed patch tokens for ViT and
    CaiT, DINO's ViT-B recipe; XCiT's tokens before class attention). ``cls_token=False`` (with
    ``avgpool_patchtokens``) keeps only the pooled dense tokens (``ssl-xcit embed --feature patch``).
    """

    n_last_blocks: int = 1
    avgpool_patchtokens: bool = False
    cls_token: bool = True

    def __post_init__(self) -> None:
        if self.n_last_blocks < 1:
            raise UserError(f"n_last_blocks must be >= 1, got {self.n_last_blocks}")
        if not self.cls_token and not self.avgpool_patchtokens:
            raise UserError(
                "a feature without the CLS embedding needs avgpool_patchtokens=True (else it is empty)"
            )
        if not self.cls_token and self.n_last_blocks != 1:
            raise UserError(
                f"n_last_blocks={self.n_last_blocks} picks CLS embeddings, but the feature has none "
                "(pooled patch tokens only); leave n_last_blocks at 1"
            )

    @property
    def name(self) -> str:
        if not self.cls_token:
            return "avgpool"
        return f"cls{self.n_last_blocks}" + ("+avgpool" if self.avgpool_patchtokens else "")

    def dim(self, backbone: nn.Module) -> int:
        """Width of this feature for ``backbone``: ``n_last_blocks`` embeddings of ``embed_dim``, plus the pooled
        dense tokens of ``dense_dim`` (not always ``embed_dim``: CrossFormer++'s are stage-3 tokens, half as wide)."""
        embed = int(getattr(backbone, "num_features", 0) or getattr(backbone, "embed_dim", 0))
        dense = int(getattr(backbone, "dense_dim", 0) or embed)
        cls = embed * self.n_last_blocks if self.cls_token else 0
        return cls + (dense if self.avgpool_patchtokens else 0)


def compute_features(
    model: nn.Module, images: torch.Tensor, config: FeatureConfig = FeatureConfig()
) -> torch.Tensor:
    """The (B, D) frozen feature of ``config`` for a batch of images."""
    if config.cls_token and config.n_last_blocks == 1 and not config.avgpool_patchtokens:
        return model(images)
    parts = list(model.get_intermediate_cls(images, config.n_last_blocks)) if config.cls_token else []
    if config.avgpool_patchtokens:
        parts.append(model.forward_patch_tokens(images)[0].mean(dim=1))
    return torch.cat(parts, dim=-1)


class FeatureExtractor(pl.LightningModule):
    """``predict_step`` -> (features, labels, indices); gathers every rank's results at the end of the epoch."""

    def __init__(self, backbone: nn.Module, config: FeatureConfig = FeatureConfig()) -> None:
        super().__init__()
        self.backbone = backbone
        self.config = config
        self._parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.result: dict[str, torch.Tensor] | None = None

    def on_predict_epoch_start(self) -> None:
        self.backbone.eval()
        self._parts = []

    def predict_step(self, batch: Any, batch_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if batch is None:  # every image of the batch was corrupt
            empty = torch.zeros(0, dtype=torch.long, device=self.device)
            return torch.zeros(0, self._local_dim(), device=self.device), empty, empty
        images, labels, indices = batch[0], batch[1], batch[2]
        feats = compute_features(self.backbone, images, self.config).float()
        out = (feats, torch.as_tensor(labels).long(), torch.as_tensor(indices).long())
        self._parts.append(out)
        return out

    def on_predict_epoch_end(self) -> None:
        dim = self._local_dim()
        if self._parts:
            feats, labels, idx = (torch.cat(x) for x in zip(*self._parts, strict=True))
        else:
            feats = torch.zeros(0, dim, device=self.device)
            labels = idx = torch.zeros(0, dtype=torch.long, device=self.device)
        self._parts = []
        if self.trainer.world_size > 1:
            feats, labels, idx = self._gather(feats, labels, idx)
        order = torch.argsort(idx)
        idx, keep = _unique_sorted(idx[order])
        self.result = {
            "features": feats[order][keep].cpu(),
            "labels": labels[order][keep].cpu(),
            "indices": idx.cpu(),
        }

    def _local_dim(self) -> int:
        return self.config.dim(self.backbone)

    def _gather(self, feats, labels, idx):
        # Ranks hold different counts (unrepeated sampler, skipped images): pad to the largest, mark pads -1.
        n = torch.tensor([feats.shape[0]], device=self.device)
        n_max = int(self.all_gather(n).max())
        pad = n_max - feats.shape[0]
        feats = torch.cat([feats, feats.new_zeros(pad, feats.shape[1])])
        labels = torch.cat([labels, labels.new_full((pad,), -1)])
        idx = torch.cat([idx, idx.new_full((pad,), -1)])
        feats, labels, idx = (self.all_gather(t).flatten(0, 1) for t in (feats, labels, idx))
        real = idx >= 0
        return feats[real], labels[real], idx[real]


def _unique_sorted(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop repeated indices of a sorted tensor (a padded distributed sampler may repeat samples)."""
    if idx.numel() == 0:
        return idx, torch.zeros(0, dtype=torch.long, device=idx.device)
    first = torch.ones_like(idx, dtype=torch.bool)
    first[1:] = idx[1:] != idx[:-1]
    return idx[first], first.nonzero().view(-1)


def _collate():
    from ssl_xcit.data.datasets import collate_skip_none

    return collate_skip_none


def predict_trainer(accelerator: str, devices: Any, precision: Any, progress: bool) -> pl.Trainer:
    """A Trainer for one inference pass over frozen weights: no logs, no checkpoints."""
    return pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=progress,
        enable_model_summary=False,
        inference_mode=True,
    )


def extract_features(
    model: nn.Module,
    dataset: Dataset,
    *,
    config: FeatureConfig = FeatureConfig(),
    batch_size: int = 128,
    num_workers: int = 4,
    accelerator: str = "auto",
    devices: int | str | list[int] = "auto",
    precision: str | int | None = None,
    progress: bool = True,
    extractor_hook: Callable[[FeatureExtractor], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Features of every readable image of ``dataset``: ``{"features" (N, D), "labels" (N,), "indices" (N,)}``.

    Rows are in dataset order; ``indices`` are the dataset positions (corrupt images are missing from it).
    ``precision`` is passed to the Trainer (e.g. ``"bf16-mixed"`` on GPU); features are returned in float32.
    """
    return run_extraction(
        model,
        dataset,
        config=config,
        batch_size=batch_size,
        num_workers=num_workers,
        accelerator=accelerator,
        devices=devices,
        precision=precision,
        progress=progress,
        extractor_hook=extractor_hook,
    )[0]


def run_extraction(
    model: nn.Module,
    dataset: Dataset,
    *,
    config: FeatureConfig,
    batch_size: int,
    num_workers: int,
    accelerator: str,
    devices: int | str | list[int],
    precision: str | int | None,
    progress: bool,
    extractor_hook: Callable[[FeatureExtractor], None] | None,
) -> tuple[dict[str, torch.Tensor], bool]:
    """:func:`extract_features` and whether this process is global rank 0 (the one that writes files)."""
    check_not_empty(dataset, "dataset")
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        collate_fn=_collate(),
        pin_memory=torch.cuda.is_available(),
        persistent_workers=False,
    )
    extractor = FeatureExtractor(model, config)
    if extractor_hook is not None:
        extractor_hook(extractor)
    trainer = predict_trainer(accelerator, devices, precision, progress)
    trainer.predict(extractor, dataloaders=loader, return_predictions=False)
    assert extractor.result is not None
    return extractor.result, trainer.is_global_zero
