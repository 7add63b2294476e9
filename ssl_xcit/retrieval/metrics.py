"""Retrieval metrics: the revisited Oxford/Paris protocol, INRIA Holidays mAP and the UKBench N-S score.

Every function takes ``ranks`` of shape ``(n_queries, n_db)``: row ``i`` lists database indices from the most
to the least similar for query ``i`` (what ``np.argsort(-scores, axis=1)`` and ``asmk`` return). Note that
revisitop's reference ``compute_map`` takes the transpose.

Average precision follows the protocol of Jegou et al. (Holidays) and Radenovic et al. (revisitop): junk images
are removed from the ranking before positions are read, and the precision-recall curve is integrated with the
trapezoid rule, so the j-th positive (0-based) at junk-corrected 0-based position r contributes
``(j / r + (j + 1) / (r + 1)) / 2 / n_positives`` with ``j / r`` taken as 1 when r = 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ssl_xcit.errors import UserError

KAPPAS = (1, 5, 10)


def _as_rank_matrix(ranks: np.ndarray, n_queries: int) -> np.ndarray:
    ranks = np.asarray(ranks)
    if ranks.ndim != 2 or ranks.shape[0] != n_queries:
        raise ValueError(
            f"ranks must have shape (n_queries={n_queries}, n_db); got {ranks.shape} "
            "(revisitop's compute_map takes the transpose: pass ranks.T if yours is (n_db, n_queries))"
        )
    return ranks


def positive_positions(ranking: np.ndarray, positives: np.ndarray, junk: np.ndarray) -> np.ndarray:
    """0-based positions of ``positives`` in ``ranking`` once every ``junk`` image before them is removed.

    An image listed in both ``positives`` and ``junk`` counts as a positive, as in revisitop.
    """
    is_pos = np.isin(ranking, positives)
    is_junk = np.isin(ranking, junk)
    # Removing junk shifts each positive up by the number of junk images ranked strictly before it. The
    # exclusive count matches revisitop's compute_ap: an image that is both positive and junk stays a positive
    # (an inclusive count would give it position -1 when ranked first, and AP = inf).
    junk_before = np.cumsum(is_junk) - is_junk
    where = np.flatnonzero(is_pos)
    return where - junk_before[where]


def average_precision(positions: np.ndarray, n_positives: int) -> float:
    """Trapezoid-rule AP from the sorted junk-corrected 0-based positions of the retrieved positives.

    ``n_positives`` counts all positives of the query, so positives missing from a truncated ranking lower AP.
    """
    positions = np.sort(np.asarray(positions, dtype=np.float64))
    if n_positives <= 0:
        raise ValueError(f"average_precision needs n_positives >= 1, got {n_positives}")
    j = np.arange(len(positions), dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        before = np.where(positions == 0, 1.0, j / positions)
    after = (j + 1) / (positions + 1)
    return float(((before + after) / 2).sum() / n_positives)


def precision_at(positions: np.ndarray, kappas: Sequence[int] = KAPPAS) -> np.ndarray:
    """revisitop's mP@k for one query: with 1-based positions p, kq = min(max(p), k) and P = #(p <= kq) / kq.

    The denominator is the rank of the last positive when all positives sit in the top k (not k itself).
    """
    pos1 = np.asarray(positions) + 1
    out = np.empty(len(kappas))
    for i, k in enumerate(kappas):
        kq = min(int(pos1.max()), k)
        out[i] = (pos1 <= kq).sum() / kq
    return out


def map_and_precision(
    ranks: np.ndarray,
    positives: Sequence[Sequence[int]],
    junk: Sequence[Sequence[int]] | None = None,
    kappas: Sequence[int] = KAPPAS,
) -> dict[str, object]:
    """mAP and mP@k over the queries that have at least one positive (the others are skipped, AP = NaN).

    A query's positives and junk must be disjoint (a UserError names the overlap).
    """
    n_q = len(positives)
    ranks = _as_rank_matrix(ranks, n_q)
    junk = junk if junk is not None else [[] for _ in range(n_q)]
    aps = np.full(n_q, np.nan)
    prs = np.full((n_q, len(kappas)), np.nan)
    for i in range(n_q):
        ok = np.asarray(positives[i], dtype=np.int64)
        if ok.size == 0:
            continue
        bad = np.intersect1d(ok, np.asarray(junk[i], dtype=np.int64))
        if bad.size:
            # revisitop's position rule would count such an image twice (AP can exceed 1): refuse it.
            raise UserError(
                f"query {i}: database images {bad[:10].tolist()} are both positive and junk; "
                "each image must be one or the other"
            )
        pos = positive_positions(ranks[i], ok, np.asarray(junk[i], dtype=np.int64))
        aps[i] = average_precision(pos, ok.size)
        prs[i] = precision_at(pos, kappas) if pos.size else 0.0
    valid = ~np.isnan(aps)
    n_valid = int(valid.sum())
    return {
        "mAP": float(aps[valid].mean()) if n_valid else float("nan"),
        **{f"mP@{k}": float(prs[valid, j].mean()) if n_valid else float("nan") for j, k in enumerate(kappas)},
        "n_queries": n_valid,
        "aps": aps.tolist(),
    }


def revisited_ground_truth(gnd: Sequence[dict], protocol: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Positives and junk per query for the revisited ``easy``, ``medium`` or ``hard`` protocol."""

    def cat(*lists):
        return np.concatenate([np.asarray(x, dtype=np.int64) for x in lists])

    if protocol == "easy":
        return [cat(g["easy"]) for g in gnd], [cat(g["junk"], g["hard"]) for g in gnd]
    if protocol == "medium":
        return [cat(g["easy"], g["hard"]) for g in gnd], [cat(g["junk"]) for g in gnd]
    if protocol == "hard":
        return [cat(g["hard"]) for g in gnd], [cat(g["junk"], g["easy"]) for g in gnd]
    raise UserError(f"unknown revisited protocol {protocol!r}; valid: easy, medium, hard")


def revisited_metrics(
    ranks: np.ndarray, gnd: Sequence[dict], kappas: Sequence[int] = KAPPAS
) -> dict[str, dict[str, object]]:
    """Revisited Oxford/Paris: mAP and mP@k for Easy, Medium and Hard (``gnd`` entries hold easy/hard/junk)."""
    out = {}
    for protocol in ("easy", "medium", "hard"):
        ok, junk = revisited_ground_truth(gnd, protocol)
        out[protocol] = map_and_precision(ranks, ok, junk, kappas)
    return out


def holidays_map(
    ranks: np.ndarray, positives: Sequence[Sequence[int]], query_db_index: Sequence[int | None]
) -> dict[str, object]:
    """Holidays mAP: each query is removed from its own ranking; its positives are the rest of its group."""
    junk = [[] if q is None else [q] for q in query_db_index]
    result = map_and_precision(ranks, positives, junk)
    return {"mAP": result["mAP"], "n_queries": result["n_queries"], "aps": result["aps"]}


def ukbench_ns_score(ranks: np.ndarray, groups: Sequence[int], top: int = 4) -> float:
    """Nister-Stewenius score: mean number of same-group images (the query included) among the top 4.

    Every database image is a query (``ranks`` is (n, n)); 4.0 is perfect for complete groups of four.
    """
    groups = np.asarray(groups)
    ranks = _as_rank_matrix(ranks, len(groups))
    return float((groups[ranks[:, :top]] == groups[:, None]).sum(axis=1).mean())
