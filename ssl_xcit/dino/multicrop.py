"""Multi-crop plumbing of DINO: one backbone pass per crop resolution, the crops of a batch, frozen buffers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn


class MultiCropWrapper(nn.Module):
    """Backbone + head over a list of crops. Consecutive crops of the same resolution are concatenated and go
    through the backbone in one call (2 calls for 2 global + N local crops); the head then runs once on all
    embeddings. Output rows are view-major: [view0 batch, view1 batch, ...]. ``return_embeddings`` also
    returns the backbone embeddings (same row order), for regularisers on the backbone output (KoLeo)."""

    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(
        self, crops: torch.Tensor | Sequence[torch.Tensor], return_embeddings: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if isinstance(crops, torch.Tensor):
            crops = [crops]
        embeddings = []
        start = 0
        while start < len(crops):
            end = start + 1
            while end < len(crops) and crops[end].shape[-2:] == crops[start].shape[-2:]:
                end += 1
            embeddings.append(self.backbone(torch.cat(list(crops[start:end]))))
            start = end
        embedding = torch.cat(embeddings)
        output = self.head(embedding)
        return (output, embedding) if return_embeddings else output


@contextlib.contextmanager
def buffers_preserved(module: nn.Module) -> Iterator[None]:
    """Restore ``module``'s buffers (BN running statistics) on exit: validation forwards in train mode must
    not leak validation images into the teacher's statistics."""
    saved = [b.detach().clone() for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, old in zip(module.buffers(), saved, strict=True):
                buf.copy_(old)


def crops_from_batch(batch: Any) -> list[torch.Tensor]:
    """The list of crop tensors of a batch: ``(crops, labels, indices)`` from the DINO datamodule, or a bare
    list of crops."""
    if isinstance(batch, dict):
        batch = batch.get("crops", batch.get("images"))
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], (list, tuple)):
        batch = batch[0]
    if isinstance(batch, torch.Tensor):
        return [batch]
    if not isinstance(batch, (list, tuple)) or not all(isinstance(c, torch.Tensor) for c in batch):
        raise TypeError(
            f"DINO expects a batch (crops, labels, indices) with crops a list of (B, 3, H, W) tensors, "
            f"got {type(batch).__name__}"
        )
    return list(batch)
