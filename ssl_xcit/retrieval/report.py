"""The results of a retrieval run: the protocol's metrics, strict-JSON values and the XCiT-style table."""

from __future__ import annotations

import numpy as np

from ssl_xcit.retrieval import metrics
from ssl_xcit.retrieval.datasets import RetrievalDataset


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
