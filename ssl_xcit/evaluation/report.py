"""Plain-text tables for evaluation results (the JSON files hold the same numbers)."""

from __future__ import annotations

from typing import Any


def format_knn_table(results: dict[str, Any]) -> str:
    """One row per k: top-1 / top-5 in %, with T, backend and sizes in the title."""
    title = (
        f"weighted k-NN ({results.get('feature', 'cls1')}, T={results['temperature']:g}, "
        f"backend {results['backend']}, {results['num_train']} train / {results['num_val']} val, "
        f"{results['num_classes']} classes)"
    )
    lines = [title, f"{'k':>6} {'top1':>7} {'top5':>7}"]
    for key, row in results["results"].items():
        clamped = f"  (k clamped to {row['k_effective']})" if row["k_effective"] != row["k"] else ""
        lines.append(f"{key:>6} {row['top1']:>7.2f} {row['top5']:>7.2f}{clamped}")
    return "\n".join(lines)


def format_linear_table(results: dict[str, Any]) -> str:
    """Per-lr accuracies of the linear probe; the best head is starred."""
    rows = results.get("per_lr", [])
    best = results.get("best", {})
    lines = [
        f"linear probe ({results.get('feature')}, {results.get('epochs')} epochs, total batch "
        f"{results.get('total_batch_size')}, mode {results.get('mode', 'full')})",
        f"{'base_lr':>10} {'lr':>10} {'top1':>7} {'top5':>7}",
    ]
    for r in rows:
        star = " *" if r == best else ""
        lines.append(f"{r['base_lr']:>10.2g} {r['lr']:>10.3g} {r['top1']:>7.2f} {r['top5']:>7.2f}{star}")
    edge = sweep_edge(rows, best)
    if edge:
        lines.append(
            f"note: the best base_lr {best['base_lr']:g} is the {edge} edge of the sweep; a "
            f"{'higher' if edge == 'top' else 'lower'} one may be better (extend --lrs)"
        )
    return "\n".join(lines)


def sweep_edge(rows: list[dict[str, Any]], best: dict[str, Any]) -> str | None:
    """``"top"``/``"bottom"`` when the best of a sweep of several lrs is its highest/lowest lr, else None."""
    lrs = sorted({r["base_lr"] for r in rows})
    if len(lrs) < 2 or not best:
        return None
    if best["base_lr"] == lrs[-1]:
        return "top"
    return "bottom" if best["base_lr"] == lrs[0] else None
