"""Retrieval metrics on the real revisited Oxford/Paris ground truth with constructed rankings.

Expected values come from an independent AP written differently (junk filtered out of the list first, then a
walk over recall steps) and from closed forms.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from ssl_xcit.retrieval.metrics import (
    average_precision,
    holidays_map,
    map_and_precision,
    positive_positions,
    revisited_metrics,
    ukbench_ns_score,
)


def reference_ap(ranking, positives, junk) -> float:
    """AP by filtering junk out of the ranking, then averaging the precision before and after each positive."""
    positives, junk = set(int(x) for x in positives), set(int(x) for x in junk)
    kept = [x for x in ranking if x not in junk]
    ap, found, prev_precision = 0.0, 0, 1.0
    for position, item in enumerate(kept, start=1):
        if item in positives:
            found += 1
            precision = found / position
            ap += (prev_precision + precision) / 2 / len(positives)
        prev_precision = found / position
    return ap


def reference_precision(ranking, positives, junk, k) -> float:
    positives, junk = set(int(x) for x in positives), set(int(x) for x in junk)
    kept = [x for x in ranking if x not in junk]
    hits = [i + 1 for i, x in enumerate(kept) if x in positives]
    kq = min(max(hits), k)
    return sum(h <= kq for h in hits) / kq


def protocol_sets(g, protocol):
    if protocol == "easy":
        return g["easy"], list(g["junk"]) + list(g["hard"])
    if protocol == "medium":
        return list(g["easy"]) + list(g["hard"]), g["junk"]
    return g["hard"], list(g["junk"]) + list(g["easy"])


def perfect_ranking(g, n_db):
    head = list(g["junk"]) + list(g["easy"]) + list(g["hard"])
    rest = np.setdiff1d(np.arange(n_db), head)
    return np.array(head + rest.tolist())


@pytest.fixture(scope="module", params=["roxford5k", "rparis6k"])
def revisited(shared_data, request):
    path = shared_data / "revisitop" / f"gnd_{request.param}.pkl"
    if not path.is_file():
        pytest.skip(f"{path} missing")
    with open(path, "rb") as handle:
        cfg = pickle.load(handle)
    return request.param, cfg


def test_perfect_ranking_with_junk_first_scores_one(revisited):
    name, cfg = revisited
    n_db, gnd = len(cfg["imlist"]), cfg["gnd"]
    ranks = np.stack([perfect_ranking(g, n_db) for g in gnd])
    out = revisited_metrics(ranks, gnd)
    for protocol in ("easy", "medium", "hard"):
        assert out[protocol]["mAP"] == pytest.approx(1.0, abs=1e-12)
        for k in (1, 5, 10):
            assert out[protocol][f"mP@{k}"] == pytest.approx(1.0, abs=1e-12)
    if name == "roxford5k":
        # Two ROxford queries have no easy positive: Easy averages over 68 queries, Medium and Hard over 70.
        assert (out["easy"]["n_queries"], out["medium"]["n_queries"], out["hard"]["n_queries"]) == (
            68,
            70,
            70,
        )
        assert sum(np.isnan(out["easy"]["aps"])) == 2


def test_reversed_ranking_matches_independent_ap(revisited):
    _, cfg = revisited
    n_db, gnd = len(cfg["imlist"]), cfg["gnd"]
    ranks = np.stack([perfect_ranking(g, n_db)[::-1] for g in gnd])
    out = revisited_metrics(ranks, gnd)
    for protocol in ("easy", "medium", "hard"):
        aps, p10 = [], []
        for i, g in enumerate(gnd):
            ok, junk = protocol_sets(g, protocol)
            if len(ok):
                aps.append(reference_ap(ranks[i], ok, junk))
                p10.append(reference_precision(ranks[i], ok, junk, 10))
        assert out[protocol]["mAP"] == pytest.approx(np.mean(aps), rel=1e-12)
        assert out[protocol]["mP@10"] == pytest.approx(np.mean(p10), rel=1e-12)
        assert out[protocol]["mAP"] < 0.05


def test_last_positive_moved_down_matches_closed_form(revisited):
    _, cfg = revisited
    n_db, gnd, m = len(cfg["imlist"]), cfg["gnd"], 10
    ranks, expected = [], {"medium": [], "hard": []}
    for g in gnd:
        r = perfect_ranking(g, n_db).tolist()
        # The last hard positive is the last positive of Medium and Hard; Easy treats it as junk.
        last = r.index(g["hard"][-1])
        r.insert(last + m, r.pop(last))
        ranks.append(r)
        for protocol in expected:
            n = len(protocol_sets(g, protocol)[0])
            # n - 1 positives at 0..n-2 (AP terms 1 each), the last at n - 1 + m.
            expected[protocol].append(((n - 1) + ((n - 1) / (n - 1 + m) + n / (n + m)) / 2) / n)
    out = revisited_metrics(np.array(ranks), gnd)
    assert out["easy"]["mAP"] == pytest.approx(1.0, abs=1e-12)
    for protocol, values in expected.items():
        assert out[protocol]["mAP"] == pytest.approx(np.mean(values), rel=1e-12)
        assert out[protocol]["mAP"] < 1.0


def test_random_ranking_near_reference_values(shared_data):
    path = shared_data / "revisitop" / "gnd_roxford5k.pkl"
    with open(path, "rb") as handle:
        cfg = pickle.load(handle)
    rng = np.random.default_rng(0)
    runs = [
        revisited_metrics(np.stack([rng.permutation(len(cfg["imlist"])) for _ in cfg["gnd"]]), cfg["gnd"])
        for _ in range(3)
    ]
    # The reference note gives E 0.0099 / M 0.0168 / H 0.0079 for a random ranking of ROxford.
    for protocol, value in (("easy", 0.0099), ("medium", 0.0168), ("hard", 0.0079)):
        assert np.mean([r[protocol]["mAP"] for r in runs]) == pytest.approx(value, rel=0.3)


def test_average_precision_closed_forms():
    assert average_precision(np.array([0, 1, 2]), 3) == pytest.approx(1.0)
    # One positive at position r: (1/r + 1/(r+1)) / 2 (precision before = 0/r for j = 0 -> 0).
    assert average_precision(np.array([4]), 1) == pytest.approx((0 / 4 + 1 / 5) / 2)
    # Positives missing from a truncated ranking still count in the denominator.
    assert average_precision(np.array([0]), 2) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="n_positives"):
        average_precision(np.array([0]), 0)


def test_precision_uses_rank_of_last_positive_as_denominator():
    # Positives at 1-based positions 1 and 3: P@5 = 2 / min(3, 5) = 2/3 (revisitop's definition).
    out = map_and_precision(np.array([[7, 1, 8, 2, 3]]), [[7, 8]], kappas=(1, 5))
    assert out["mP@1"] == pytest.approx(1.0)
    assert out["mP@5"] == pytest.approx(2 / 3)


def test_rank_matrix_orientation_is_checked():
    with pytest.raises(ValueError, match="n_queries=2"):
        map_and_precision(np.zeros((5, 2), dtype=int), [[0], [1], [2], [3], [4]][:2])


def test_holidays_map_excludes_query_from_its_ranking():
    # Group A: query 0 with positives 1, 2; group B: query 3 with positive 4; image 5 unrelated.
    positives, query_idx = [[1, 2], [4]], [0, 3]
    perfect = np.array([[0, 1, 2, 3, 4, 5], [3, 4, 0, 1, 2, 5]])
    assert holidays_map(perfect, positives, query_idx)["mAP"] == pytest.approx(1.0)
    # Query ranked anywhere (even last) changes nothing once it is removed.
    query_last = np.array([[1, 2, 3, 4, 5, 0], [4, 0, 1, 2, 5, 3]])
    assert holidays_map(query_last, positives, query_idx)["mAP"] == pytest.approx(1.0)
    # Query A: [5, 1, 0, 2] -> without the query: 5, 1, 2 -> positives at 1 and 2: AP = 5/12.
    # Query B: [0, 1, 3, 2, 5, 4] -> without the query: positive at 4: AP = (0 + 1/5) / 2 = 1/10.
    mixed = np.array([[5, 1, 0, 2, 3, 4], [0, 1, 3, 2, 5, 4]])
    out = holidays_map(mixed, positives, query_idx)
    assert out["aps"] == pytest.approx([5 / 12, 1 / 10])
    assert out["mAP"] == pytest.approx((5 / 12 + 1 / 10) / 2)
    # Without the exclusion the query itself would be a non-positive at the top: a different, lower value.
    assert map_and_precision(mixed, positives)["mAP"] < out["mAP"]


def test_ukbench_ns_score():
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    perfect = np.array(
        [
            [i]
            + [j for j in range(8) if groups[j] == groups[i] and j != i]
            + [j for j in range(8) if groups[j] != groups[i]]
            for i in range(8)
        ]
    )
    assert ukbench_ns_score(perfect, groups) == pytest.approx(4.0)
    # Every query finds only itself in the top 4 (others of its group pushed to 5..8).
    worst = np.array(
        [
            [i]
            + [j for j in range(8) if groups[j] != groups[i]]
            + [j for j in range(8) if groups[j] == groups[i] and j != i]
            for i in range(8)
        ]
    )
    assert ukbench_ns_score(worst, groups) == pytest.approx(1.0)


def revisitop_positions(ranking, positives, junk):
    """revisitop's compute_ap position loop: each positive moves up by the junk ranked strictly before it."""
    pos = [i for i, x in enumerate(ranking) if x in set(positives)]
    junk_at = [i for i, x in enumerate(ranking) if x in set(junk)]
    k = ij = 0
    out = []
    for p in pos:
        while ij < len(junk_at) and p > junk_at[ij]:
            k, ij = k + 1, ij + 1
        out.append(p - k)
    return out


def test_positive_that_is_also_junk_counts_as_positive_like_revisitop():
    ranking = np.array([0, 1, 2, 3, 4, 5])
    positives, junk = np.array([0, 2, 5]), np.array([0, 3])
    pos = positive_positions(ranking, positives, junk)
    assert pos.tolist() == revisitop_positions(ranking.tolist(), [0, 2, 5], [0, 3]) == [0, 1, 3]
    # The old inclusive count gave the first positive position -1, hence AP = inf.
    assert np.isfinite(average_precision(pos, 3))
    assert average_precision(pos, 3) == pytest.approx((1 + 1 + (2 / 3 + 3 / 4) / 2) / 3)


def test_overlapping_positives_and_junk_are_refused():
    # UKBench-style: the query (database image 0) among its positives, and junk as "the query itself".
    ranking = np.array([[0, 1, 5, 2, 3, 4, 6, 7]])
    with pytest.raises(ValueError, match=r"query 0: database images \[0\] are both positive and junk"):
        map_and_precision(ranking, [np.array([0, 1, 2, 3])], [np.array([0])])
