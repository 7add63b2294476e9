"""The stages of a retrieval run, each cached on disk: descriptors, PCA and codebook, encoding and ranking.

:class:`DescriptorStore` holds what every stage shares (the model, the cache, the key fields of the model and
resolution); :func:`cls_ranking` and :func:`local_ranking` are the two method families, each returning the
ranking and the fields it adds to the results.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ssl_xcit.data.datasets import load_image
from ssl_xcit.evaluation.cache import (
    checkpoint_fingerprint,
    code_fingerprint,
    library_versions,
    load_cached,
    module_fingerprint,
    save_cached,
    source_fingerprint,
)
from ssl_xcit.retrieval.asmk_index import AsmkIndex
from ssl_xcit.retrieval.config import DEFAULT_K, RetrievalConfig
from ssl_xcit.retrieval.datasets import ImageList
from ssl_xcit.retrieval.descriptors import (
    MULTISCALE,
    _rescale,
    extract_global,
    extract_local,
    split_counts,
)
from ssl_xcit.retrieval.images import RecordRef, images_fingerprint, load_resized, target_size, to_tensor
from ssl_xcit.retrieval.pca import FIT_VERSION as PCA_FIT_VERSION
from ssl_xcit.retrieval.pca import PCA
from ssl_xcit.retrieval.vlad import train_codebook, vlad_batch
from ssl_xcit.utils.io import sha256_json

# Bumped when descriptor extraction changes meaning, so cached descriptors of an older version are not reused
# (changes to the model code are caught by code_fingerprint(), to the image code by input_code_fingerprint()).
EXTRACTION_VERSION = (
    "retrieval-v1: longer side=R, sides rounded to nearest patch multiple, bicubic, jpeg draft"
)


def model_fingerprint(model: nn.Module, weights: str | None) -> str:
    """sha256 of the checkpoint file the model was built from, or of the module itself (class, structure,
    tensors) when ``weights`` is None: a module passed in is keyed on what it holds, whatever file it came from."""
    if weights is not None:
        return checkpoint_fingerprint(weights)
    return module_fingerprint(model)


def input_code_fingerprint() -> str:
    """Source fingerprint of our code from an image file to the model input: decoding, cropping, resizing
    (to the resolution, then to each scale of multi-scale descriptors)."""
    return source_fingerprint(
        load_image, load_resized, target_size, to_tensor, ImageList, RecordRef, _rescale
    )


def _subsample(n: int, limit: int | None) -> np.ndarray:
    # Evenly spaced indices: deterministic and spread over the whole set.
    if limit is None or n <= limit:
        return np.arange(n)
    return np.linspace(0, n - 1, limit).round().astype(np.int64)


def rank(
    queries: torch.Tensor, database: torch.Tensor, chunk_bytes: int = 1 << 28
) -> tuple[np.ndarray, np.ndarray]:
    """Cosine ranking (descriptors are L2-normalised): ``(ranks, scores)``, both (n_queries, n_db).

    The (float16) database is converted to float32 a chunk of at most ``chunk_bytes`` at a time, so a 131,072-d
    VLAD of ROxford (1.3 GB in float16) never exists in float32 (2.6 GB).
    """
    q = queries.float()
    chunk = max(1, chunk_bytes // (4 * database.shape[1]))
    scores = torch.cat([q @ database[i : i + chunk].float().T for i in range(0, len(database), chunk)], dim=1)
    scores = scores.numpy()
    return np.argsort(-scores, axis=1, kind="stable"), scores


class DescriptorStore:
    """Cached computations of one run: compute on a miss, store, reuse on a hit (``directory`` None: no cache)."""

    def __init__(
        self,
        model: nn.Module,
        config: RetrievalConfig,
        arch: str,
        directory: Path | None,
        model_key: str | None = None,
    ) -> None:
        """``model_key``: the model's cache key (:func:`model_fingerprint`), computed by the caller before it moved
        the model to the run's device; None keys on ``config.weights`` (a model built from that file)."""
        self.model, self.config, self.directory = model, config, directory
        self.base_meta = {
            "kind": "retrieval",
            "model": model_key if model_key is not None else model_fingerprint(model, config.weights),
            "arch": arch,
            "resolution": config.resolution,
            "extraction": EXTRACTION_VERSION,
            "code": code_fingerprint(),
            "libraries": library_versions(),
            "input_code": input_code_fingerprint(),
        }
        self.extract = {"device": config.device, "num_workers": config.num_workers}

    def get(
        self, name: str, meta: dict, compute: Callable[[], dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        if self.directory is not None:
            hit = load_cached(self.directory, name, meta)
            if hit is not None:
                return hit
        out = compute()
        if self.directory is not None:
            save_cached(self.directory, name, meta, out)
        return out

    @staticmethod
    def set_meta(images: ImageList) -> dict:
        """The key fields of an image set: its files and how they are read (crops, EXIF, rotations)."""
        return {
            "files": images_fingerprint(images.paths),
            "layout": sha256_json([images.bbx, images.exif_transpose, sorted(images.rotations.items())]),
        }

    def _progress(self, name: str) -> str:
        return name if self.config.progress else ""

    def global_features(self, images: ImageList, name: str, meta: dict) -> torch.Tensor:
        """CLS descriptors (multi-scale when ``meta["scales"]`` has several) of ``images``."""
        return self.get(
            f"retrieval-cls-{name}",
            {**meta, **self.set_meta(images)},
            lambda: {
                "features": extract_global(
                    self.model, images, meta["scales"], progress=self._progress(name), **self.extract
                )
            },
        )["features"]

    def local_features(
        self, images: ImageList, name: str, meta: dict, pca: PCA | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Local descriptors of ``images`` (projected by ``pca`` when given) and their per-image counts."""
        out = self.get(
            f"retrieval-local-{name}",
            {**meta, **self.set_meta(images)},
            lambda: dict(
                zip(
                    ("descriptors", "counts"),
                    extract_local(
                        self.model,
                        images,
                        self.config.max_local,
                        pca,
                        progress=self._progress(name),
                        tokens=self.config.local_tokens,
                        **self.extract,
                    ),
                    strict=True,
                )
            ),
        )
        return out["descriptors"], out["counts"]


def cls_ranking(
    store: DescriptorStore,
    db_images: ImageList,
    q_images: ImageList | None,
    train_images: ImageList | None,
    timings: dict[str, float],
) -> tuple[np.ndarray, dict[str, object]]:
    """Rank with CLS descriptors (PCA-whitened on ``train_images`` with ``config.whiten``); ``q_images`` None:
    the queries are the database images."""
    config = store.config
    scales = MULTISCALE if config.multiscale else (1.0,)
    meta = {**store.base_meta, "descriptor": "cls", "scales": list(scales)}
    t = time.perf_counter()
    db = store.global_features(db_images, "database", meta)
    q = db if q_images is None else store.global_features(q_images, "queries", meta)
    timings["extract_s"] = time.perf_counter() - t
    if config.whiten:
        t = time.perf_counter()
        train = store.global_features(train_images, "train", meta)
        pca = PCA.fit(train, min(config.pca_dim, train.shape[1]), whiten_power=0.5)
        db, q = pca(db), pca(q)
        timings["whiten_s"] = time.perf_counter() - t
    t = time.perf_counter()
    ranks, _ = rank(q, db)
    timings["search_s"] = time.perf_counter() - t
    return ranks, {"codebook_size": None, "descriptor_dim": int(db.shape[1])}


def learn_local_codebook(
    store: DescriptorStore, train_images: ImageList, local_meta: dict, k: int, timings: dict[str, float]
) -> tuple[PCA, torch.Tensor, dict]:
    """PCA and a k-means codebook of ``k`` words learnt on the local descriptors of ``train_images``.

    Returns ``(pca, centroids, pca_meta)``; ``pca_meta`` keys everything projected by this PCA.
    """
    config = store.config
    t = time.perf_counter()
    train_desc, _ = store.local_features(train_images, "train", local_meta)
    timings["extract_train_s"] = time.perf_counter() - t
    train_desc = train_desc[_subsample(len(train_desc), config.max_train_descriptors)]
    pca_meta = {
        **local_meta,
        **store.set_meta(train_images),
        "dim": config.local_dim,
        "whiten_power": config.local_whiten,
        "max_train_descriptors": config.max_train_descriptors,
        "pca_fit": PCA_FIT_VERSION,
    }
    t = time.perf_counter()
    pca = PCA.from_state_dict(
        store.get(
            "retrieval-pca",
            pca_meta,
            lambda: PCA.fit(train_desc.float(), config.local_dim, config.local_whiten).state_dict(),
        )
    )
    codebook_meta = {**pca_meta, "k": k, "kmeans_iters": config.kmeans_iters, "seed": config.seed}
    centroids = store.get(
        "retrieval-codebook",
        codebook_meta,
        lambda: {
            "centroids": torch.from_numpy(
                train_codebook(pca(train_desc.float()), k, config.kmeans_iters, config.seed)
            )
        },
    )["centroids"]
    timings["train_s"] = time.perf_counter() - t
    return pca, centroids, pca_meta


def local_ranking(
    store: DescriptorStore,
    db_images: ImageList,
    q_images: ImageList | None,
    train_images: ImageList,
    timings: dict[str, float],
) -> tuple[np.ndarray, dict[str, object]]:
    """Rank with VLAD or ASMK over PCA-reduced local descriptors; ``q_images`` None: queries = database."""
    config = store.config
    k = config.codebook_size or DEFAULT_K[config.method]
    local_meta = {
        **store.base_meta,
        "descriptor": {
            "last_block": "patch_tokens_before_class_attention",
            "final_norm": "patch_tokens_final_norm",
        }[config.local_tokens],
        "max_local": config.max_local,
    }
    pca, centroids, pca_meta = learn_local_codebook(store, train_images, local_meta, k, timings)
    proj_meta = {**local_meta, "pca": sha256_json(pca_meta)}
    t = time.perf_counter()
    db_desc, db_counts = store.local_features(db_images, "database", proj_meta, pca)
    q_desc, q_counts = (
        (db_desc, db_counts)
        if q_images is None
        else store.local_features(q_images, "queries", proj_meta, pca)
    )
    timings["extract_s"] = time.perf_counter() - t
    t = time.perf_counter()
    result: dict[str, object] = {}
    if config.method == "vlad":
        db = vlad_batch(db_desc, db_counts, centroids, config.vlad_power, config.vlad_intra_norm)
        q = vlad_batch(q_desc, q_counts, centroids, config.vlad_power, config.vlad_intra_norm)
        timings["encode_s"] = time.perf_counter() - t
        t = time.perf_counter()
        ranks, _ = rank(q, db)
        timings["search_s"] = time.perf_counter() - t
        result.update(descriptor_dim=int(db.shape[1]))
    else:
        index = AsmkIndex(
            centroids.numpy(),
            binary=config.asmk_binary,
            alpha=config.asmk_alpha,
            threshold=config.asmk_threshold,
            ma_db=config.asmk_ma_db,
            ma_query=config.asmk_ma_query,
            use_idf=config.asmk_idf,
        )
        stats = index.build(split_counts(db_desc, db_counts, 256))
        timings["index_s"] = time.perf_counter() - t
        t = time.perf_counter()
        ranks, _ = index.query(q_desc.numpy(), q_counts.numpy())
        timings["search_s"] = time.perf_counter() - t
        result.update(descriptor_dim=int(pca.dim), ivf_stats={k: float(v) for k, v in stats.items()})
    result.update(
        codebook_size=k,
        local_descriptors_per_image=float(db_counts.float().mean()),
        n_train_images=len(train_images),
    )
    return ranks, result
