"""One retrieval benchmark run: descriptors -> (PCA, codebook) -> ranking -> metrics -> table and JSON.

    cls  : CLS embedding, L2; optional multi-scale (1, 1/sqrt2, 1/2) and PCA-whitening learnt on --train-images.
    vlad : patch tokens before class attention, top-N by norm, L2 -> PCA (128) -> L2 -> faiss k-means codebook
           -> VLAD (signed sqrt, intra-norm, L2) -> cosine.
    asmk : the same 128-d local descriptors -> asmk (binary, alpha 3, tau 0, MA 5 query / 1 database).

Everything learnt (PCA, codebooks) comes from a separate training image set and is cached on disk, as are the
descriptors of every image set; cache keys hold the model fingerprint, the model code, the resolution, the
method parameters and the file list, so a change in any of them recomputes.

Modules: :mod:`.config` (the settings), :mod:`.stages` (the cached stages and rankings), :mod:`.report`
(metrics, JSON, table); this one wires them together.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from ssl_xcit.evaluation.cache import default_cache_dir
from ssl_xcit.retrieval.config import DEFAULT_K, METHODS, RetrievalConfig
from ssl_xcit.retrieval.datasets import ImageList, RetrievalDataset, list_images, load_dataset
from ssl_xcit.retrieval.report import evaluate, format_table, json_safe
from ssl_xcit.retrieval.stages import (
    EXTRACTION_VERSION,
    DescriptorStore,
    _subsample,
    cls_ranking,
    local_ranking,
    model_fingerprint,
    rank,
)
from ssl_xcit.utils.io import atomic_write_json
from ssl_xcit.utils.modes import eval_mode

__all__ = [
    "DEFAULT_K",
    "EXTRACTION_VERSION",
    "METHODS",
    "RetrievalConfig",
    "evaluate",
    "format_table",
    "json_safe",
    "model_fingerprint",
    "rank",
    "run_retrieval",
]


def _image_sets(
    dataset: RetrievalDataset, config: RetrievalConfig, patch: int
) -> tuple[ImageList, ImageList | None, ImageList | None]:
    """``(database, queries, train)``; queries is None when they are the database images (UKBench style),
    so they are extracted once; train is None without ``--train-images``."""

    def image_set(paths, bbx=None, exif=True, rotations=None) -> ImageList:
        return ImageList(paths, config.resolution, patch, bbx, exif, rotations)

    db_images = image_set(dataset.database, None, dataset.exif_transpose, dataset.rotations)
    q_images = image_set(dataset.queries, dataset.query_bbx, dataset.exif_transpose, dataset.rotations)
    if q_images.paths == db_images.paths and all(b is None for b in q_images.bbx):
        q_images = None
    if config.train_images == "database":
        train_images = image_set(list(dataset.database), None, dataset.exif_transpose, dataset.rotations)
    elif config.train_images is not None:
        train_paths = list_images(config.train_images)
        train_images = image_set(
            [train_paths[i] for i in _subsample(len(train_paths), config.max_train_images)]
        )
    else:
        train_images = None
    return db_images, q_images, train_images


def run_retrieval(config: RetrievalConfig, model: nn.Module | None = None) -> dict[str, object]:
    """Run one benchmark and return the results dict (also written to ``config.output`` as JSON).

    A ``model`` passed in is used in eval mode on ``config.device`` and given back in the modes it came in with,
    on the device it came from (a live module, e.g. DINO's teacher during fit, carries on training).
    """
    config.validate()
    if config.threads:
        torch.set_num_threads(config.threads)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    dataset = load_dataset(
        config.dataset,
        config.data_root,
        crop_queries=config.crop_queries,
        gnd_path=config.gnd,
        rotations=config.rotations,
    )
    built_from_weights = model is None
    if model is None:
        from ssl_xcit.models import build_backbone

        model = build_backbone(config.weights, config.arch)
    # Keyed where the caller's tensors are (a copy on another device may not be readable, e.g. "meta").
    model_key = model_fingerprint(model, config.weights if built_from_weights else None)
    with eval_mode(model, config.device):  # once for every extraction step of the run
        arch = getattr(model, "name", None) or config.arch or type(model).__name__
        cache_dir = (
            None if config.no_cache else Path(config.cache_dir) if config.cache_dir else default_cache_dir()
        )
        store = DescriptorStore(model, config, arch, cache_dir, model_key)
        db_images, q_images, train_images = _image_sets(dataset, config, int(model.size_multiple))
        timings["setup_s"] = time.perf_counter() - t0
        ranking = cls_ranking if config.method == "cls" else local_ranking
        ranks, result = ranking(store, db_images, q_images, train_images, timings)
    result.update(
        dataset=dataset.name,
        protocol=dataset.protocol,
        method=config.method,
        arch=arch,
        weights=config.weights,
        resolution=config.resolution,
        n_database=len(dataset.database),
        n_queries=len(dataset.queries),
        metrics=evaluate(dataset, ranks),
        top_ranks=ranks[:, :10].tolist(),
        timings={k: round(v, 3) for k, v in timings.items()},
        config=asdict(config),
    )
    result["table"] = format_table([result])
    if config.output:
        atomic_write_json(json_safe(result), config.output)
    return result
