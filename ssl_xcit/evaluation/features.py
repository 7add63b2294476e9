"""Frozen-feature extraction from any backbone and checkpoint, batched, distributed, and cached on disk.

``extract_features(model, dataset)`` runs a tiny LightningModule through ``Trainer.predict``: Lightning shards the
dataset over the GPUs (an unrepeated distributed sampler, so no image is counted twice), each rank returns
``(features, labels, indices)``, and the ranks' results are all-gathered and put back in dataset order by
index. Corrupt images come back as ``None`` from the dataset and are dropped by the collate function, so they
are simply absent from ``indices``: features and labels stay aligned. On CPU it is one process.

``dataset_features(...)`` adds the cache: the key is the weights (the checkpoint's sha256 and the model name, or
the class, structure and tensors of a module passed in), the transform's full ``repr``, the feature type, a
fingerprint of the file list (paths, sizes, mtimes, labels), the precision, the extraction version, the versions
of torch, torchvision, Pillow and timm, the source of our decoding and resizing code and a fingerprint of the
model code. The backbone is built only on a cache miss, so a re-run with the same inputs does not touch the
model or the images.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

from ssl_xcit.data.transforms import describe_transform
from ssl_xcit.errors import UserError
from ssl_xcit.evaluation import cache as feature_cache

log = logging.getLogger(__name__)

# Bumped when extraction outside the model code changes meaning (batching, feature assembly, collate), so
# cached features of an older version are not reused; model-code changes are caught by code_fingerprint().
EXTRACTION_VERSION = "knn-v1: compute_features cast to float32, corrupt images dropped, dataset order kept"

__all__ = [
    "FeatureConfig",
    "FeatureExtractor",
    "compute_features",
    "extract_features",
    "dataset_features",
    "check_same_classes",
    "check_not_empty",
    "build_eval_backbone",
]


@dataclass(frozen=True)
class FeatureConfig:
    """Which frozen feature to take from the backbone.

    ``n_last_blocks=1, avgpool_patchtokens=False`` is the final normed CLS embedding, i.e. ``model(x)``: what DINO
    uses for XCiT in both k-NN and linear evaluation. ``n_last_blocks=n`` concatenates the CLS embeddings
    computed from the last n XCA blocks (DINO's ViT-S linear recipe uses 4); ``avgpool_patchtokens`` appends
    the mean of the backbone's dense tokens (``forward_patch_tokens``: the final normed patch tokens for ViT and
    CaiT, DINO's ViT-B recipe; XCiT's tokens before class attention).
    """

    n_last_blocks: int = 1
    avgpool_patchtokens: bool = False

    def __post_init__(self) -> None:
        if self.n_last_blocks < 1:
            raise UserError(f"n_last_blocks must be >= 1, got {self.n_last_blocks}")

    @property
    def name(self) -> str:
        return f"cls{self.n_last_blocks}" + ("+avgpool" if self.avgpool_patchtokens else "")

    def dim(self, backbone: nn.Module) -> int:
        """Width of this feature for ``backbone``: ``n_last_blocks`` embeddings of ``embed_dim``, plus the pooled
        dense tokens of ``dense_dim`` (not always ``embed_dim``: CrossFormer++'s are stage-3 tokens, half as wide)."""
        embed = int(getattr(backbone, "num_features", 0) or getattr(backbone, "embed_dim", 0))
        dense = int(getattr(backbone, "dense_dim", 0) or embed)
        return embed * self.n_last_blocks + (dense if self.avgpool_patchtokens else 0)


def compute_features(
    model: nn.Module, images: torch.Tensor, config: FeatureConfig = FeatureConfig()
) -> torch.Tensor:
    """The (B, D) frozen feature of ``config`` for a batch of images."""
    if config.n_last_blocks == 1 and not config.avgpool_patchtokens:
        return model(images)
    parts = list(model.get_intermediate_cls(images, config.n_last_blocks))
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
    return _run_extraction(
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


def _run_extraction(
    model,
    dataset,
    *,
    config,
    batch_size,
    num_workers,
    accelerator,
    devices,
    precision,
    progress,
    extractor_hook,
) -> tuple[dict[str, torch.Tensor], bool]:
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
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=progress,
        enable_model_summary=False,
        inference_mode=True,
    )
    trainer.predict(extractor, dataloaders=loader, return_predictions=False)
    assert extractor.result is not None
    return extractor.result, trainer.is_global_zero


def check_not_empty(dataset: Dataset, name: str, root: str | os.PathLike | None = None) -> None:
    """Raise a clear error for a split without images."""
    if len(dataset) == 0:  # type: ignore[arg-type]
        where = f" ({root})" if root is not None else ""
        raise UserError(f"the {name} split{where} has no images; it needs at least one readable image")


def check_same_classes(train_classes: list[str] | None, val_classes: list[str] | None) -> None:
    """Train and val must have the same class folders, else label i would mean different classes in each."""
    if train_classes is None or val_classes is None:
        missing = "train" if train_classes is None else "val"
        raise UserError(
            f"the {missing} split has no class labels; k-NN and linear evaluation need ImageFolder trees "
            "(one subfolder per class) for both train and val"
        )
    if list(train_classes) == list(val_classes):
        return
    only_train = sorted(set(train_classes) - set(val_classes))
    only_val = sorted(set(val_classes) - set(train_classes))
    raise UserError(
        "train and val class sets differ: "
        f"only in train: {only_train or 'none'}; only in val: {only_val or 'none'} "
        f"({len(train_classes)} train vs {len(val_classes)} val classes). Both splits need the same class "
        "subfolders so that label indices mean the same class."
    )


def build_eval_backbone(weights: str | os.PathLike | None, arch: str | None, seed: int = 0) -> nn.Module:
    """The frozen backbone for evaluation: ``build_backbone`` (any checkpoint layout), eval mode, no grads.

    Without ``weights`` the backbone is randomly initialised from ``seed`` (a baseline); ``arch`` is then
    required.
    """
    from ssl_xcit.models import build_backbone

    if weights is None:
        if arch is None:
            raise UserError("give --weights, or --arch NAME to evaluate a randomly initialised backbone")
        torch.manual_seed(seed)
    elif not Path(weights).is_file():
        raise FileNotFoundError(f"weights file not found: {weights}")
    model = build_backbone(None if weights is None else str(weights), arch)
    model.requires_grad_(False)
    return model.eval()


# Packages whose code is keyed by version (feature_cache.library_versions), not by source.
_LIBRARIES = ("PIL", "timm", "torch", "torchvision")


def _transform_parts(transform: Any) -> list[Any]:
    """``transform`` and, recursively, the transforms it chains (``Compose.transforms`` and the like)."""
    parts, todo = [], [transform]
    while todo:
        part = todo.pop(0)
        if part is None:
            continue
        parts.append(part)
        inner = getattr(part, "transforms", None)
        if isinstance(inner, (list, tuple)):
            todo.extend(inner)
    return parts


def input_code_fingerprint(dataset: Any) -> str:
    """Source fingerprint of our code between an image file and the model input: the dataset class (its
    ``__getitem__`` picks the reader), the reader it calls (the transform's own ``read``, else
    ``ssl_xcit.data.datasets.load_image``) and every transform class outside the libraries (whose code is
    keyed by their versions)."""
    from ssl_xcit.data import datasets

    transform = getattr(dataset, "transform", None)
    reader = getattr(transform, "read", None) or datasets.load_image
    ours = [
        type(part)
        for part in _transform_parts(transform)
        if type(part).__module__.split(".")[0] not in _LIBRARIES
    ]
    return feature_cache.source_fingerprint(type(dataset), reader, *ours)


def feature_meta(
    dataset: Any,
    *,
    weights: str | os.PathLike | None,
    arch: str | None,
    config: FeatureConfig,
    seed: int = 0,
    precision: str | int | None = None,
    extra: Mapping[str, Any] | None = None,
    model: nn.Module | None = None,
) -> dict[str, Any]:
    """The cache key: everything the features depend on.

    With a ``model`` the key holds its :func:`~ssl_xcit.evaluation.cache.module_fingerprint` and ignores
    ``weights``, ``arch`` and ``seed``: the module given is what computes the features.
    """
    samples = getattr(dataset, "samples", None)
    if samples is None:
        raise TypeError("dataset_features needs a dataset with a .samples list of (path, label)")
    from_file = model is None
    meta = {
        "checkpoint_sha256": feature_cache.checkpoint_fingerprint(weights) if from_file else None,
        "arch": (arch or "inferred-from-checkpoint") if from_file else None,
        "init_seed": seed if from_file and weights is None else None,
        "module": None if from_file else feature_cache.module_fingerprint(model),
        "libraries": feature_cache.library_versions(),
        "input_code": input_code_fingerprint(dataset),
        "transform": describe_transform(getattr(dataset, "transform", None)),
        "classes": list(getattr(dataset, "classes", None) or []),
        "files": feature_cache.files_fingerprint([p for p, _ in samples], [int(y) for _, y in samples]),
        "num_files": len(samples),
        "feature": config.name,
        "precision": feature_cache.precision_key(precision),
        "extraction": EXTRACTION_VERSION,
        "code": feature_cache.code_fingerprint(),
    }
    meta.update(extra or {})
    return meta


def dataset_features(
    dataset: Any,
    split: str,
    *,
    weights: str | os.PathLike | None,
    arch: str | None,
    config: FeatureConfig = FeatureConfig(),
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    seed: int = 0,
    model: nn.Module | Callable[[], nn.Module] | None = None,
    batch_size: int = 128,
    num_workers: int = 4,
    accelerator: str = "auto",
    devices: int | str | list[int] = "auto",
    precision: str | int | None = None,
    progress: bool = True,
    extractor_hook: Callable[[FeatureExtractor], None] | None = None,
) -> tuple[dict[str, torch.Tensor], bool]:
    """Features of ``dataset`` (cached per split): returns ``(tensors, cache_hit)``.

    ``model`` skips building the backbone here, so callers evaluating train and val share one. A module is
    keyed on its own class, structure and tensors (``weights``, ``arch`` and ``seed`` then play no part); a
    zero-argument factory is called only on a cache miss, so the key is ``weights``, ``arch`` and ``seed``,
    which it must build. A missing weights file raises ``FileNotFoundError`` naming it before anything else
    runs.
    """
    check_not_empty(dataset, split, getattr(dataset, "root", None))
    module = model if isinstance(model, nn.Module) else None
    meta = feature_meta(
        dataset, weights=weights, arch=arch, config=config, seed=seed, precision=precision, model=module
    )
    cache_dir = Path(cache_dir) if cache_dir is not None else feature_cache.default_cache_dir()
    if use_cache:
        cached = feature_cache.load_cached(cache_dir, split, meta)
        if cached is not None:
            log.info("feature cache hit for %s: %s", split, feature_cache.cache_path(cache_dir, split, meta))
            return cached, True
    if model is None:
        model = build_eval_backbone(weights, arch, seed)
    elif not isinstance(model, nn.Module):
        model = model()
    result, is_zero = _run_extraction(
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
    )
    if result["features"].shape[0] == 0:
        raise UserError(f"the {split} split has no readable images: all {len(dataset)} files failed to load")
    if use_cache and is_zero:
        feature_cache.save_cached(cache_dir, split, meta, result)
    return result, False


def split_features(
    train_ds: Any,
    val_ds: Any,
    *,
    weights: str | os.PathLike | None,
    arch: str | None,
    config: FeatureConfig,
    seed: int = 0,
    **extract: Any,
) -> tuple[tuple[dict[str, torch.Tensor], bool], tuple[dict[str, torch.Tensor], bool], nn.Module | None]:
    """Features of a train and a val split through the cache: ``((train, hit), (val, hit), backbone)``.

    The two splits share one backbone, built only if one of them misses the cache (``backbone`` is None when
    both hit). ``extract`` takes the other keyword arguments of :func:`dataset_features` (cache_dir, ...).
    """
    backbone: list[nn.Module] = []

    def shared_backbone() -> nn.Module:
        if not backbone:
            backbone.append(build_eval_backbone(weights, arch, seed))
        return backbone[0]

    common = dict(weights=weights, arch=arch, config=config, seed=seed, model=shared_backbone, **extract)
    train = dataset_features(train_ds, "train", **common)
    val = dataset_features(val_ds, "val", **common)
    return train, val, (backbone[0] if backbone else None)
