"""ASMK (aggregated selective match kernel, Tolias et al.) through the ``asmk`` package.

The codebook is learnt by our own faiss k-means (``vlad.train_codebook``, cached with the PCA) and injected into
asmk's ``Codebook``, so asmk never clusters; this keeps one k-means for VLAD and ASMK and lets a codebook learnt
elsewhere (e.g. on a GPU for k = 65,536) be used unchanged.

asmk pitfalls handled here: image ids must be sorted ascending and contiguous (``slice_unique`` asserts it);
an image with no descriptor would silently drop out of the query results (so it is an error); the codebook's
``params['size']`` must equal the training step's ``{"size": K}`` exactly; multiple assignment cannot exceed K.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import numpy as np
from asmk import ASMKMethod
from asmk import codebook as asmk_codebook
from asmk import index as asmk_index

from ssl_xcit.errors import UserError


def asmk_params(
    k: int,
    binary: bool = True,
    alpha: float = 3.0,
    threshold: float = 0.0,
    ma_db: int = 1,
    ma_query: int = 5,
    use_idf: bool = False,
) -> dict:
    """asmk's nested parameter dict; the defaults are HOW's ECCV'20 setting (binary, alpha 3, tau 0, MA 5/1)."""
    return {
        "index": {"gpu_id": None},
        "train_codebook": {"codebook": {"size": int(k)}},
        "build_ivf": {
            "kernel": {"binary": bool(binary)},
            "ivf": {"use_idf": bool(use_idf)},
            "quantize": {"multiple_assignment": int(ma_db)},
            "aggregate": {},
        },
        "query_ivf": {
            "quantize": {"multiple_assignment": int(ma_query)},
            "aggregate": {},
            "search": {"topk": None},
            "similarity": {"similarity_threshold": float(threshold), "alpha": float(alpha)},
        },
    }


def _image_ids(counts: np.ndarray, what: str) -> np.ndarray:
    counts = np.asarray(counts, dtype=np.int64)
    empty = np.flatnonzero(counts == 0)
    if empty.size:
        raise UserError(
            f"{what} images {empty[:10].tolist()} have no local descriptor; ASMK needs at least one"
        )
    return np.repeat(np.arange(len(counts), dtype=np.int64), counts)


class AsmkIndex:
    """An ASMK inverted file over database images, queried with the local descriptors of query images."""

    def __init__(self, centroids: np.ndarray, **params) -> None:
        centroids = np.ascontiguousarray(centroids, dtype=np.float32)
        k = centroids.shape[0]
        self.params = asmk_params(k, **params)
        for step in ("build_ivf", "query_ivf"):
            ma = self.params[step]["quantize"]["multiple_assignment"]
            if not 1 <= ma <= k:
                raise UserError(
                    f"{step} multiple assignment {ma} must be between 1 and the codebook size {k}"
                )
        if k < 1024:
            warnings.warn(
                f"ASMK codebook k={k} is below the 1,024-65,536 of the literature; fine for tests, weak for results",
                stacklevel=2,
            )
        codebook = asmk_codebook.Codebook(asmk_index.initialize_index(None), size=k)
        codebook.index(centroids)
        self.method = ASMKMethod(self.params, {}, codebook=codebook)
        self.n_db = 0

    def build(self, chunks: Iterable[tuple[np.ndarray, np.ndarray]]) -> dict:
        """Index the database from ``(descriptors (n, d), counts per image)`` chunks, in image order.

        Chunking bounds memory: only one chunk of descriptors is float32 at a time. Returns asmk's ivf stats.
        """
        builder = self.method.create_ivf_builder()
        for descriptors, counts in chunks:
            imids = _image_ids(counts, "database") + self.n_db
            builder.add(np.ascontiguousarray(descriptors, dtype=np.float32), imids)
            self.n_db += len(counts)
        self.method = self.method.add_ivf_builder(builder)
        return self.method.metadata["build_ivf"]["ivf_stats"]

    def query(self, descriptors: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(ranks, scores)``, both (n_queries, n_db), database indices by decreasing ASMK similarity."""
        if self.n_db == 0:
            raise RuntimeError("AsmkIndex.query called before build()")
        imids = _image_ids(counts, "query")
        _, images, ranks, scores = self.method.query_ivf(
            np.ascontiguousarray(descriptors, dtype=np.float32), imids
        )
        if not np.array_equal(images, np.arange(len(counts))) or ranks.shape[1] != self.n_db:
            raise RuntimeError(f"asmk returned results for {len(images)} queries x {ranks.shape[1]} images")
        return ranks, scores
