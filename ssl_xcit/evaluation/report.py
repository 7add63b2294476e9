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
    """Per-lr accuracies of the linear probe; the best head is starred (per C for ``--solver lbfgs``)."""
    if results.get("mode") == "lbfgs":
        return format_lbfgs_table(results)
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


def format_lbfgs_table(results: dict[str, Any]) -> str:
    """The C search of ``--solver lbfgs`` (held-out top-1 per C, best starred) and val top-1/top-5 at the best C."""
    best = results["best"]
    lines = [
        f"linear probe ({results.get('feature')}, L-BFGS logistic regression, C chosen on "
        f"{results['num_holdout']} held-out train images, mode lbfgs)",
        f"{'C':>10} {'held-out top1':>14}",
    ]
    for r in results["per_C"]:
        star = " *" if r["best"] else ""
        lines.append(f"{r['C']:>10.3g} {r['holdout_top1']:>14.2f}{star}")
    lines.append(f"val at C {best['C']:.3g} (refit on all {results['num_train']} train images): "
                 f"top1 {best['top1']:.2f}  top5 {best['top5']:.2f}")  # fmt: skip
    if results.get("c_at_edge"):
        lines.append(f"note: the best C {best['C']:g} is at the edge of the searched range 1e-6..1e6")
    if not best.get("converged", True):
        lines.append(
            "note: L-BFGS reached its iteration limit at the best C (scikit-learn ConvergenceWarning)"
        )
    return "\n".join(lines)
