"""Dense frozen features per image, through the same cache as ``knn``'s.

Each image gives a (h*w, C) grid of final-norm patch tokens, the backbone's ``get_dense_layers`` (DINOv2's
``get_intermediate_layers(..., norm=True)``): the last block's (``layers=1``), or the last 4 blocks'
concatenated along channels (``layers=4``, DINOv2's multi-layer linear probe), each block's grid resized
bilinearly to the finest one (CrossFormer++'s blocks may span two stages). A split is stored as all its tokens
in one (sum h*w, C) tensor (float16 when every value fits, which halves the cache and the memory a split takes;
the probe's BatchNorm makes the rounding immaterial), ``grids`` (n, 2) and ``indices``: images of different
sizes share one entry.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader

from ssl_xcit.errors import UserError
from ssl_xcit.evaluation import cache as feature_cache
from ssl_xcit.evaluation.features import predict_trainer
from ssl_xcit.evaluation.keys import feature_meta

__all__ = ["DENSE_EXTRACTION_VERSION", "DenseFeature", "dense_tokens", "split_dense_features"]

DENSE_EXTRACTION_VERSION = (
    "dense-v2: final-norm patch tokens per image, float16 when in range, grids by image"
)
LAYER_CHOICES = (1, 4)
_FP16_MAX = torch.finfo(torch.float16).max


@dataclass(frozen=True)
class DenseFeature:
    """Which patch tokens: the final ones (1) or the last 4 blocks' concatenated (4)."""

    layers: int = 1

    def __post_init__(self) -> None:
        if self.layers not in LAYER_CHOICES:
            raise UserError(
                f"--layers {self.layers} is not supported; valid: 1 (last block) or 4 (last 4 blocks)"
            )

    @property
    def name(self) -> str:
        return f"patch{self.layers}"


def _grid_of(tokens: Tensor, height: int, width: int) -> tuple[int, int]:
    """The (h, w) grid of a block's N tokens for an input of height x width (one token per stride x stride)."""
    count = tokens.shape[1]
    stride = math.sqrt(height * width / count)
    grid = (round(height / stride), round(width / stride))
    if grid[0] * grid[1] != count:
        raise RuntimeError(f"{count} tokens do not form a grid for a {height}x{width} input")
    return grid


def dense_tokens(backbone: nn.Module, images: Tensor, layers: int = 1) -> tuple[Tensor, tuple[int, int]]:
    """Final-norm patch tokens (B, h*w, C) of a batch of equally sized images and their grid (h, w): the last
    ``layers`` blocks' ``get_dense_layers``, concatenated along channels at the finest grid."""
    height, width = images.shape[-2:]
    outputs = backbone.get_dense_layers(images, layers)
    if len(outputs) == 1:
        return outputs[0], _grid_of(outputs[0], height, width)
    finest = max(outputs, key=lambda t: t.shape[1])
    grid = _grid_of(finest, height, width)
    maps = []
    for tokens in outputs:
        h, w = _grid_of(tokens, height, width)
        fmap = tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], h, w)
        if (h, w) != grid:
            fmap = F.interpolate(fmap, size=grid, mode="bilinear", align_corners=False)
        maps.append(fmap)
    return torch.cat(maps, dim=1).flatten(2).transpose(1, 2), grid


def _collate_lists(batch: list[Any]) -> tuple[list[Tensor], list[int]]:
    return [item[0] for item in batch], [int(item[2]) for item in batch]


class DenseExtractor(pl.LightningModule):
    """``predict_step`` over lists of images (any sizes): equal sizes are run together; per image the tokens
    (h*w, C), kept on the CPU in dataset order."""

    def __init__(self, backbone: nn.Module, layers: int) -> None:
        super().__init__()
        self.backbone, self.layers = backbone, layers
        self.parts: dict[int, tuple[Tensor, tuple[int, int]]] = {}

    def on_predict_epoch_start(self) -> None:
        self.backbone.eval()
        self.parts = {}

    def predict_step(self, batch: tuple[list[Tensor], list[int]], batch_idx: int) -> int:
        images, indices = batch
        by_size: dict[tuple[int, ...], list[int]] = {}
        for i, image in enumerate(images):
            by_size.setdefault(tuple(image.shape), []).append(i)
        for members in by_size.values():
            stack = torch.stack([images[i] for i in members]).to(self.device)
            tokens, grid = dense_tokens(self.backbone, stack, self.layers)
            for row, i in enumerate(members):
                self.parts[indices[i]] = (tokens[row].float().cpu(), (int(grid[0]), int(grid[1])))
        return len(images)  # kept in self.parts; Lightning warns about a step that returns None


def extract_dense(
    backbone: nn.Module,
    dataset: Any,
    *,
    layers: int,
    batch_size: int,
    num_workers: int,
    accelerator: str,
    precision: str | int | None,
    progress: bool,
) -> dict[str, Tensor]:
    """``{"tokens" (sum h*w, C), "grids" (n, 2), "indices" (n,)}`` of every image, in dataset order (one device:
    dense token sets of different sizes do not all-gather as one tensor)."""
    loader = DataLoader(
        dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers, collate_fn=_collate_lists
    )
    extractor = DenseExtractor(backbone, layers)
    trainer = predict_trainer(accelerator, 1, precision, progress)
    trainer.predict(extractor, dataloaders=loader, return_predictions=False)
    order = sorted(extractor.parts)
    tokens = torch.cat([extractor.parts[i][0] for i in order])
    if bool(tokens.isfinite().all()) and float(tokens.abs().max()) <= _FP16_MAX:
        tokens = tokens.half()
    return {
        "tokens": tokens,
        "grids": torch.tensor([extractor.parts[i][1] for i in order], dtype=torch.long).reshape(-1, 2),
        "indices": torch.tensor(order, dtype=torch.long),
    }


def split_dense_features(
    splits: dict[str, Any],
    backbone: nn.Module,
    *,
    weights: str | os.PathLike | None,
    arch: str | None,
    feature: DenseFeature,
    seed: int,
    cache_dir: str | os.PathLike | None,
    use_cache: bool,
    precision: str | int | None,
    key_on_module: bool = False,
    **extract: Any,
) -> dict[str, tuple[dict[str, Tensor], bool]]:
    """Dense features of each named dataset through the cache: ``{split: (tensors, cache_hit)}``.

    ``backbone`` is the one built from ``weights``/``arch``/``seed`` (its size multiple sets the transform, so
    it exists before the lookup); the key names those, as ``knn``'s does, and it runs only on a miss. With
    ``key_on_module`` (a module passed in from Python) the key is the module's own fingerprint instead."""
    cache_dir = cache_dir if cache_dir is not None else feature_cache.default_cache_dir()
    out = {}
    for split, dataset in splits.items():
        meta = feature_meta(
            dataset,
            weights=weights,
            arch=arch,
            config=feature,  # type: ignore[arg-type]  # the key reads only .name
            seed=seed,
            precision=precision,
            extra={"extraction": DENSE_EXTRACTION_VERSION},
            model=backbone if key_on_module else None,
        )
        name = f"segment-{split}"
        cached = feature_cache.load_cached(cache_dir, name, meta) if use_cache else None
        if cached is not None:
            out[split] = (cached, True)
            continue
        result = extract_dense(backbone, dataset, layers=feature.layers, precision=precision, **extract)
        if use_cache:
            feature_cache.save_cached(cache_dir, name, meta, result)
        out[split] = (result, False)
    return out
