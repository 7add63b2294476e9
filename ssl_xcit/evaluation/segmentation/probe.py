"""The linear segmentation head, trained as DINOv2's linear probe is, and its fast mode on cached tokens.

DINOv2's linear protocol (its mmsegmentation ``BNHead`` configs): BatchNorm on the frozen patch tokens, a 1x1
convolution to class logits (weight ~ N(0, 0.01), bias 0), logits upsampled bilinearly (align_corners=False) to
the mask size, cross-entropy with an ignore index averaged over ALL the batch's pixels, ignored ones counting 0
(mmsegmentation's default ``avg_non_ignore=False``), AdamW (lr 1e-3, weight decay 1e-4, betas 0.9/0.999) under
mmcv's poly schedule (power 1, min lr 0) with linear warmup over the first 1500/40000 of the steps from 1e-6 of
the decayed lr (:func:`poly_warmup_factors`).

:class:`SegmentationProbe` is the head; here it also trains on cached tokens of whole images (``--fast``): no
augmentation, and every epoch costs only the head. A 1x1 convolution is a linear layer per token, and
BatchNorm2d over (B, h, w) is BatchNorm1d over the batch's tokens, so images of any sizes share a batch as one
(sum h*w, C) matrix. The default protocol (augmented crops, sliding windows) is :mod:`.protocol`.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["DEFAULT_LR", "SegmentationProbe", "TokenMasks", "collate_tokens", "poly_warmup_factors"]

DEFAULT_LR = 1e-3
WEIGHT_DECAY = 1e-4
WARMUP_FRACTION = 1500 / 40000  # DINOv2's 1,500 warmup iterations of 40,000
WARMUP_RATIO = 1e-6  # mmcv's warmup_ratio in DINOv2's config


def poly_warmup_factors(total: int, warmup: int, warmup_ratio: float = WARMUP_RATIO) -> list[float]:
    """The lr factor of each iteration 0 .. total - 1: mmcv's poly decay (power 1, min lr 0), times its linear
    warmup, which rises from ``warmup_ratio`` to 1 over ``warmup`` iterations."""
    factors = []
    for it in range(total):
        factor = 1.0 - it / total
        if it < warmup:
            factor *= 1.0 - (1.0 - it / warmup) * (1.0 - warmup_ratio)
        factors.append(factor)
    return factors


class TokenMasks(Dataset):
    """Cached tokens of a split (``tokens``, ``grids``, ``indices`` as :mod:`.features` stores them) paired with
    the masks: item i is ``(tokens (h*w, C) float32, (h, w), mask (H, W) int64, dataset index)``."""

    def __init__(self, features: dict[str, Tensor], masks: list[Tensor]) -> None:
        self.tokens = features["tokens"]
        self.grids = [tuple(int(v) for v in g) for g in features["grids"]]
        self.indices = [int(i) for i in features["indices"]]
        counts = [h * w for h, w in self.grids]
        self.offsets = [0, *torch.tensor(counts).cumsum(0).tolist()] if counts else [0]
        if self.offsets[-1] != self.tokens.shape[0]:
            raise ValueError(f"grids cover {self.offsets[-1]} tokens, the cache holds {self.tokens.shape[0]}")
        self.masks = [masks[i] for i in self.indices]

    def __len__(self) -> int:
        return len(self.grids)

    def __getitem__(self, i: int) -> tuple[Tensor, tuple[int, int], Tensor, int]:
        tokens = self.tokens[self.offsets[i] : self.offsets[i + 1]].float()
        return tokens, self.grids[i], self.masks[i], self.indices[i]


def collate_tokens(batch: list[Any]) -> tuple[list[Tensor], list[tuple[int, int]], list[Tensor], list[int]]:
    """Lists, not stacks: images of a batch may differ in size."""
    tokens, grids, masks, indices = zip(*batch, strict=True)
    return list(tokens), list(grids), list(masks), list(indices)


class SegmentationProbe(pl.LightningModule):
    """BatchNorm + linear map of patch tokens to class logits, trained with cross-entropy at the mask size."""

    def __init__(
        self,
        dim: int,
        num_classes: int,
        ignore_index: int,
        lr: float = DEFAULT_LR,
        weight_decay: float = WEIGHT_DECAY,
    ) -> None:
        super().__init__()
        self.lr, self.weight_decay = lr, weight_decay
        self.bn = nn.BatchNorm1d(dim)
        self.classifier = nn.Linear(dim, num_classes)
        nn.init.normal_(self.classifier.weight, mean=0.0, std=0.01)
        nn.init.zeros_(self.classifier.bias)
        self.ignore_index = ignore_index

    def grid_logits(self, tokens: Tensor, grid: tuple[int, int]) -> Tensor:
        """Class logits (B, K, h, w) of a batch of token grids (B, h*w, C)."""
        logits = self.classifier(self.bn(tokens.flatten(0, 1).float()))
        return logits.reshape(tokens.shape[0], *grid, -1).permute(0, 3, 1, 2)

    def forward(self, tokens: list[Tensor], grids: list[tuple[int, int]]) -> list[Tensor]:
        """Class logits (K, h, w) per image, at the token grid."""
        logits = self.classifier(self.bn(torch.cat(tokens)))
        out = []
        for part, (h, w) in zip(logits.split([t.shape[0] for t in tokens]), grids, strict=True):
            out.append(part.transpose(0, 1).reshape(-1, h, w))
        return out

    def mask_logits(self, tokens: list[Tensor], grids: list[tuple[int, int]], sizes: list[tuple[int, ...]]):
        """Logits (K, H, W) per image, upsampled bilinearly to its mask's size."""
        return [
            F.interpolate(lg[None], size=tuple(size), mode="bilinear", align_corners=False)[0]
            for lg, size in zip(self(tokens, grids), sizes, strict=True)
        ]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        tokens, grids, masks, _ = batch
        logits = self.mask_logits(tokens, grids, [m.shape for m in masks])
        total = sum(
            F.cross_entropy(lg[None], m[None], ignore_index=self.ignore_index, reduction="sum")
            for lg, m in zip(logits, masks, strict=True)
        )
        loss = total / sum(m.numel() for m in masks)  # over every pixel, ignored ones adding 0
        self.log("train/loss", loss, prog_bar=True, batch_size=len(masks))
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> list[tuple[int, Tensor]]:
        """Per image: its dataset index and predicted class ids at the mask's size (int64, on the CPU)."""
        tokens, grids, masks, indices = batch
        logits = self.mask_logits(tokens, grids, [m.shape for m in masks])
        return [(i, lg.argmax(0).cpu()) for i, lg in zip(indices, logits, strict=True)]

    def configure_optimizers(self) -> Any:
        head = [p for name, p in self.named_parameters() if name.startswith(("bn.", "classifier."))]
        optimizer = torch.optim.AdamW(head, lr=self.lr, weight_decay=self.weight_decay)
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        factors = poly_warmup_factors(total, round(total * WARMUP_FRACTION))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: factors[min(step, total - 1)])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
