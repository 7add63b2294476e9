"""One retrieval benchmark run: descriptors -> (PCA, codebook) -> ranking -> metrics -> table and JSON.

    cls  : CLS embedding, L2; optional multi-scale (1, 1/sqrt2, 1/2) and PCA-whitening learnt on --train-images.
    vlad : patch tokens before class attention, top-N by norm, L2 -> PCA (128) -> L2 -> faiss k-means codebook
           -> VLAD (signed sqrt, intra-norm, L2) -> cosine.
    asmk : the same 128-d local descriptors -> asmk (binary, alpha 3, tau 0, MA 5 query / 1 database).

Everything learnt (PCA, codebooks) comes from a separate training image set and is cached on disk, as are the
descriptors of every image set; cache keys hold the model fingerprint, the resolution, the method parameters
and the file list, so a change in any of them recomputes.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ssl_xcit.evaluation.cache import (
    checkpoint_fingerprint,
    default_cache_dir,
    files_fingerprint,
    load_cached,
    save_cached,
)
from ssl_xcit.retrieval import metrics
from ssl_xcit.retrieval.asmk_index import AsmkIndex
from ssl_xcit.retrieval.datasets import ImageList, RetrievalDataset, list_images, load_dataset
from ssl_xcit.retrieval.descriptors import MULTISCALE, extract_global, extract_local, split_counts
from ssl_xcit.retrieval.pca import PCA
from ssl_xcit.retrieval.vlad import train_codebook, vlad_batch
from ssl_xcit.utils.io import atomic_write_json, sha256_json

METHODS = ("cls", "vlad", "asmk")
DEFAULT_K = {"vlad": 256, "asmk": 1024}
# Bumped when descriptor extraction changes meaning, so cached descriptors of an older version are not reused.
EXTRACTION_VERSION = (
    "retrieval-v1: longer side=R, sides rounded to nearest patch multiple, bicubic, jpeg draft"
)


@dataclass
class RetrievalConfig:
    """Settings of one run; the CLI flags map one to one onto these fields."""

    dataset: str
    data_root: str
    method: str = "cls"
    weights: str | None = None
    arch: str | None = None
    resolution: int = 768
    codebook_size: int | None = None
    train_images: str | None = None
    max_train_images: int | None = None
    max_local: int | None = 1000
    local_dim: int = 128
    local_whiten: float = 0.0
    multiscale: bool = False
    whiten: bool = False
    pca_dim: int = 128
    crop_queries: bool = True
    gnd: str | None = None
    rotations: str | None = None
    vlad_power: float = 0.5
    vlad_intra_norm: bool = True
    asmk_binary: bool = True
    asmk_alpha: float = 3.0
    asmk_threshold: float = 0.0
    asmk_ma_query: int = 5
    asmk_ma_db: int = 1
    asmk_idf: bool = False
    kmeans_iters: int = 20
    max_train_descriptors: int = 1_000_000
    seed: int = 0
    cache_dir: str | None = None
    no_cache: bool = False
    device: str = "cpu"
    num_workers: int = 0
    threads: int | None = None
    output: str | None = None
    progress: bool = False

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown retrieval method {self.method!r}; valid: {', '.join(METHODS)}")
        if self.resolution < 16:
            raise ValueError(f"resolution must be at least one patch (>= 16 px), got {self.resolution}")
        if self.max_local is not None and self.max_local < 1:
            raise ValueError(f"max_local must be >= 1 (or None for all tokens), got {self.max_local}")
        if self.method in ("vlad", "asmk") and self.train_images is None:
            raise ValueError(
                f"--method {self.method} learns PCA and a codebook: give --train-images (a folder or .txt list of "
                "images independent of the benchmark), or --train-images database to learn on the database itself "
                "(not independent; results are then optimistic)"
            )
        if self.method == "cls" and self.whiten and self.train_images is None:
            raise ValueError("--whiten learns PCA-whitening: give --train-images (or 'database')")


class _Cache:
    """Thin wrapper over ``ssl_xcit.evaluation.cache``: compute on a miss, store, reuse on a hit."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory

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


def model_fingerprint(model: nn.Module, weights: str | None) -> str:
    """sha256 of the checkpoint file, or of the parameters when the model was built in memory."""
    if weights is not None:
        return checkpoint_fingerprint(weights)
    digest = hashlib.sha256()
    for key, value in sorted(model.state_dict().items()):
        digest.update(key.encode())
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


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


def _local_entry(extracted: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"descriptors": extracted[0], "counts": extracted[1]}


def evaluate(dataset: RetrievalDataset, ranks: np.ndarray) -> dict[str, object]:
    """The metrics of the dataset's protocol for ``ranks`` (n_queries, n_db)."""
    if dataset.protocol == "revisited":
        return metrics.revisited_metrics(ranks, dataset.gnd)
    if dataset.protocol == "holidays":
        return metrics.holidays_map(ranks, [g["ok"] for g in dataset.gnd], dataset.query_db_index)
    junk = [
        np.concatenate([g["junk"], [q]]).astype(np.int64) if q is not None else g["junk"]
        for g, q in zip(dataset.gnd, dataset.query_db_index, strict=True)
    ]
    out = metrics.map_and_precision(ranks, [g["ok"] for g in dataset.gnd], junk)
    if dataset.protocol == "ukbench":
        out["N-S"] = metrics.ukbench_ns_score(ranks, dataset.groups)
    return out


def run_retrieval(config: RetrievalConfig, model: nn.Module | None = None) -> dict[str, object]:
    """Run one benchmark and return the results dict (also written to ``config.output`` as JSON)."""
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
    if model is None:
        from ssl_xcit.models import build_backbone

        model = build_backbone(config.weights, config.arch)
    model.eval()
    arch = getattr(model, "name", None) or config.arch or type(model).__name__
    patch = int(model.size_multiple)
    cache = _Cache(
        None if config.no_cache else Path(config.cache_dir) if config.cache_dir else default_cache_dir()
    )
    base_meta = {
        "kind": "retrieval",
        "model": model_fingerprint(model, config.weights),
        "arch": arch,
        "resolution": config.resolution,
        "extraction": EXTRACTION_VERSION,
    }
    progress = config.progress

    def image_set(paths, bbx=None, exif=True, rotations=None):
        return ImageList(paths, config.resolution, patch, bbx, exif, rotations)

    def set_meta(images: ImageList) -> dict:
        return {
            "files": files_fingerprint(images.paths),
            "layout": sha256_json([images.bbx, images.exif_transpose, sorted(images.rotations.items())]),
        }

    db_images = image_set(dataset.database, None, dataset.exif_transpose, dataset.rotations)
    q_images = image_set(dataset.queries, dataset.query_bbx, dataset.exif_transpose, dataset.rotations)
    if config.train_images == "database":
        train_paths = list(dataset.database)
        train_images = image_set(train_paths, None, dataset.exif_transpose, dataset.rotations)
    elif config.train_images is not None:
        train_paths = list_images(config.train_images)
        train_images = image_set(
            [train_paths[i] for i in _subsample(len(train_paths), config.max_train_images)]
        )
    else:
        train_images = None
    # UKBench-style benchmarks query with the database images themselves: extract them once.
    same_images = q_images.paths == db_images.paths and all(b is None for b in q_images.bbx)
    timings["setup_s"] = time.perf_counter() - t0
    extract = {"device": config.device, "num_workers": config.num_workers}
    result: dict[str, object] = {}

    if config.method == "cls":
        scales = MULTISCALE if config.multiscale else (1.0,)
        meta = {**base_meta, "descriptor": "cls", "scales": list(scales)}

        def cls_features(images: ImageList, name: str) -> torch.Tensor:
            return cache.get(
                f"retrieval-cls-{name}",
                {**meta, **set_meta(images)},
                lambda: {
                    "features": extract_global(
                        model, images, scales, progress=name if progress else "", **extract
                    )
                },
            )["features"]

        t = time.perf_counter()
        db = cls_features(db_images, "database")
        q = db if same_images else cls_features(q_images, "queries")
        timings["extract_s"] = time.perf_counter() - t
        if config.whiten:
            t = time.perf_counter()
            train = cls_features(train_images, "train")
            pca = PCA.fit(train, min(config.pca_dim, train.shape[1]), whiten_power=0.5)
            db, q = pca(db), pca(q)
            timings["whiten_s"] = time.perf_counter() - t
        t = time.perf_counter()
        ranks, _ = rank(q, db)
        timings["search_s"] = time.perf_counter() - t
        result.update(codebook_size=None, descriptor_dim=int(db.shape[1]))
    else:
        k = config.codebook_size or DEFAULT_K[config.method]
        local_meta = {
            **base_meta,
            "descriptor": "patch_tokens_before_class_attention",
            "max_local": config.max_local,
        }
        t = time.perf_counter()
        train = cache.get(
            "retrieval-local-train",
            {**local_meta, **set_meta(train_images)},
            lambda: _local_entry(
                extract_local(
                    model, train_images, config.max_local, progress="train" if progress else "", **extract
                )
            ),
        )
        timings["extract_train_s"] = time.perf_counter() - t
        train_desc = train["descriptors"][_subsample(len(train["descriptors"]), config.max_train_descriptors)]
        pca_meta = {
            **local_meta,
            **set_meta(train_images),
            "dim": config.local_dim,
            "whiten_power": config.local_whiten,
            "max_train_descriptors": config.max_train_descriptors,
        }
        t = time.perf_counter()
        pca = PCA.from_state_dict(
            cache.get(
                "retrieval-pca",
                pca_meta,
                lambda: PCA.fit(train_desc.float(), config.local_dim, config.local_whiten).state_dict(),
            )
        )
        codebook_meta = {**pca_meta, "k": k, "kmeans_iters": config.kmeans_iters, "seed": config.seed}
        centroids = cache.get(
            "retrieval-codebook",
            codebook_meta,
            lambda: {
                "centroids": torch.from_numpy(
                    train_codebook(pca(train_desc.float()), k, config.kmeans_iters, config.seed)
                )
            },
        )["centroids"]
        timings["train_s"] = time.perf_counter() - t
        del train, train_desc
        proj_meta = {**local_meta, "pca": sha256_json(pca_meta)}

        def local_features(images: ImageList, name: str) -> tuple[torch.Tensor, torch.Tensor]:
            out = cache.get(
                f"retrieval-local-{name}",
                {**proj_meta, **set_meta(images)},
                lambda: _local_entry(
                    extract_local(
                        model, images, config.max_local, pca, progress=name if progress else "", **extract
                    )
                ),
            )
            return out["descriptors"], out["counts"]

        t = time.perf_counter()
        db_desc, db_counts = local_features(db_images, "database")
        q_desc, q_counts = (db_desc, db_counts) if same_images else local_features(q_images, "queries")
        timings["extract_s"] = time.perf_counter() - t
        t = time.perf_counter()
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


def json_safe(obj):
    """NaN (the AP of a query without positives) becomes null so the file is strict JSON."""
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def _metric_columns(result: dict) -> list[tuple[str, float]]:
    m = result["metrics"]
    if result["protocol"] == "revisited":
        name = {"roxford5k": "R-Oxford5k", "rparis6k": "R-Paris6k"}.get(result["dataset"], result["dataset"])
        return [(f"{name} Medium", 100 * m["medium"]["mAP"]), (f"{name} Hard", 100 * m["hard"]["mAP"])]
    if result["protocol"] == "holidays":
        return [("Holidays mAP", 100 * m["mAP"])]
    if result["protocol"] == "ukbench":
        return [("UKBench N-S", m["N-S"]), ("mAP", 100 * m["mAP"])]
    return [(f"{result['dataset']} mAP", 100 * m["mAP"]), ("mP@1", 100 * m["mP@1"])]


def format_table(results: list[dict]) -> str:
    """Rows shaped like XCiT Table D.4: base model, method, k, resolution, then the benchmark's mAPs."""
    header = ["Base model", "Method", "k", "Resolution"] + [c for c, _ in _metric_columns(results[0])]
    rows = [
        [
            r["arch"],
            {"cls": "CLS token", "vlad": "VLAD", "asmk": "ASMK"}[r["method"]],
            "-" if r.get("codebook_size") is None else str(r["codebook_size"]),
            str(r["resolution"]),
        ]
        + [f"{v:.1f}" if c != "UKBench N-S" else f"{v:.2f}" for c, v in _metric_columns(r)]
        for r in results
    ]
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=True)]
    lines = [
        "  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip() for line in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
