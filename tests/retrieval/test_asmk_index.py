"""ASMK through the asmk package: scores checked against an independent numpy ASMK, and the pitfalls."""

from __future__ import annotations

import numpy as np
import pytest

from ssl_xcit.retrieval.asmk_index import AsmkIndex


def reference_asmk(centroids, db, q, alpha, threshold):
    """Binary ASMK (ECCV'20 normalisation, no idf, MA 1) written directly from the kernel's definition."""

    def words(x):
        return np.linalg.norm(x[:, None] - centroids[None], axis=2).argmin(1)

    def aggregate(x):
        w = words(x)
        return {int(c): (x[w == c] - centroids[c]).sum(0) > 0 for c in np.unique(w)}

    qa = aggregate(q)
    scores = []
    for image in db:
        da = aggregate(image)
        total = 0.0
        for c, bits in qa.items():
            if c in da:
                s = 1 - 2 * np.mean(bits != da[c])  # 1 - 2 * normalised Hamming distance
                total += s**alpha if s >= threshold else 0.0
        scores.append(total / np.sqrt(len(da)) / np.sqrt(len(qa)))
    return np.array(scores)


pytestmark = pytest.mark.filterwarnings("ignore:ASMK codebook k=")


def make_toy(k, d=32, seed=0):
    rng = np.random.default_rng(seed)
    centroids = rng.standard_normal((k, d)).astype(np.float32)
    db = [
        (centroids[rng.integers(0, k, 20)] + 0.5 * rng.standard_normal((20, d))).astype(np.float32)
        for _ in range(6)
    ]
    return centroids, db


@pytest.fixture(scope="module")
def toy():
    return make_toy(8)


def test_scores_match_independent_asmk(toy):
    centroids, db = toy
    q = db[3] + 0.05 * np.random.default_rng(1).standard_normal(db[3].shape).astype(np.float32)
    index = AsmkIndex(centroids, alpha=3.0, threshold=0.0, ma_db=1, ma_query=1)
    counts = np.array([len(x) for x in db])
    index.build([(np.concatenate(db[:4]), counts[:4]), (np.concatenate(db[4:]), counts[4:])])
    ranks, scores = index.query(q, np.array([len(q)]))
    expected = reference_asmk(centroids, db, q, alpha=3.0, threshold=0.0)
    np.testing.assert_allclose(scores[0], expected[ranks[0]], rtol=1e-5, atol=1e-6)
    assert ranks[0, 0] == 3 and ranks.shape == (1, 6)


def test_identical_image_ranks_first_with_multiple_assignment():
    # MA 5 needs a codebook well above 5 words: with k = 8 the query's 5 assignments blur every word.
    centroids, db = make_toy(32)
    index = AsmkIndex(centroids, ma_query=5, ma_db=1)
    index.build([(np.concatenate(db), np.array([len(x) for x in db]))])
    ranks, _ = index.query(np.concatenate(db), np.array([len(x) for x in db]))
    assert ranks.shape == (6, 6)
    assert np.array_equal(ranks[:, 0], np.arange(6))


def test_pitfalls_are_clear_errors(toy):
    centroids, db = toy
    with pytest.raises(ValueError, match=r"query_ivf multiple assignment 9 .* codebook size 8"):
        AsmkIndex(centroids, ma_query=9)
    index = AsmkIndex(centroids)
    with pytest.raises(ValueError, match=r"database images \[1\] have no local descriptor"):
        index.build([(np.concatenate(db[:2]), np.array([40, 0]))])
    with pytest.raises(RuntimeError, match="before build"):
        AsmkIndex(centroids).query(db[0], np.array([20]))


def test_small_codebook_warns(toy):
    with pytest.warns(UserWarning, match="k=8 is below"):
        AsmkIndex(toy[0])
