"""Linear probe by L-BFGS logistic regression on frozen features: CLIP's linear-probe protocol, scikit-learn's solver.

CLIP (Radford et al. 2021, appendix A.3) trains scikit-learn's L-BFGS logistic regression (at most 1,000
iterations) on frozen features and picks the L2 strength by a search on held-out data: first one value every
two decades from 1e-6 to 1e6, then around the best value the interval is halved until the resolution is 8 steps
per decade. Here the held-out data is a stratified 20 % of the training split
(:func:`ssl_xcit.data.splits.stratified_split`, by path, seeded); the best ``C`` is refit on the whole training
split and judged on val, reported like the SGD probes (``best``: top-1 and top-5 on val).

Ties in held-out accuracy (common on small splits) go to the lower held-out log-loss. The features are the
cached eval-transform features of ``ssl-xcit knn`` and ``linear --fast``. The fits run in this one process (on
every rank of a DDP extraction, each computing the same result).
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import numpy as np
import torch

from ssl_xcit.errors import UserError

__all__ = [
    "C_RANGE",
    "HOLDOUT_FRACTION",
    "MAX_ITER",
    "STEPS_PER_DECADE",
    "fit_logistic",
    "sweep_c",
    "lbfgs_probe",
]

# CLIP's search: 10^-6 .. 10^6, one start value every two decades, refined to 8 steps per decade.
C_RANGE = (-6.0, 6.0)
STEPS_PER_DECADE = 8
MAX_ITER = 1000
HOLDOUT_FRACTION = 0.2


def fit_logistic(features: np.ndarray, labels: np.ndarray, C: float, seed: int = 0):
    """scikit-learn's multinomial L-BFGS logistic regression; returns the model and whether it converged."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    model = LogisticRegression(C=C, solver="lbfgs", max_iter=MAX_ITER, random_state=seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        model.fit(features, labels)
    converged = not any(issubclass(w.category, ConvergenceWarning) for w in caught)
    return model, converged


def _topk(model, features: np.ndarray, labels: np.ndarray, k: int) -> float:
    """Top-k accuracy in % (k clamped to the number of classes the model knows)."""
    scores = model.decision_function(features)
    if scores.ndim == 1:  # two classes: one score column for classes_[1]
        scores = np.stack([-scores, scores], axis=1)
    k = min(k, scores.shape[1])
    best = model.classes_[np.argsort(-scores, axis=1, kind="stable")[:, :k]]
    return 100.0 * float((best == labels[:, None]).any(axis=1).mean())


def sweep_c(
    train_x: np.ndarray, train_y: np.ndarray, held_x: np.ndarray, held_y: np.ndarray, seed: int = 0
) -> tuple[float, list[dict[str, Any]]]:
    """CLIP's parametric search for C on held-out data: ``(best C, one row per C tried, sorted by C)``."""
    from sklearn.metrics import log_loss

    low, high = C_RANGE
    tried: dict[float, dict[str, Any]] = {}

    def evaluate(exponent: float) -> None:
        if exponent in tried or not low <= exponent <= high:
            return
        C = 10.0**exponent
        model, converged = fit_logistic(train_x, train_y, C, seed)
        proba = model.predict_proba(held_x)
        tried[exponent] = {
            "C": C,
            "holdout_top1": round(_topk(model, held_x, held_y, 1), 4),
            "holdout_loss": round(float(log_loss(held_y, proba, labels=model.classes_)), 6),
            "converged": converged,
        }

    def best() -> float:
        return max(tried, key=lambda e: (tried[e]["holdout_top1"], -tried[e]["holdout_loss"]))

    for exponent in np.arange(low, high + 1, 2.0):
        evaluate(float(exponent))
    step = 2.0
    while step > 1.0 / STEPS_PER_DECADE:
        step /= 2.0  # powers of two: the exponents stay exact binary fractions, so `in tried` is exact
        centre = best()
        evaluate(centre - step)
        evaluate(centre + step)
    chosen = best()
    rows = [{**tried[e], "best": e == chosen} for e in sorted(tried)]
    return tried[chosen]["C"], rows


def lbfgs_probe(
    train: dict[str, torch.Tensor],
    val: dict[str, torch.Tensor],
    train_paths: list[str],
    *,
    num_classes: int,
    seed: int = 0,
) -> dict[str, Any]:
    """Sweep C on a held-out part of ``train``, refit on all of it, score ``val``; the results dict.

    ``train``/``val`` hold ``features`` (N, D) and ``labels`` (N,); ``train_paths`` names the train rows (the
    held-out split is drawn by path, so it does not depend on the row order).
    """
    from ssl_xcit.data.splits import stratified_split

    x = train["features"].double().numpy()
    y = train["labels"].numpy()
    if len(np.unique(y)) < 2:
        raise UserError(
            f"a linear probe needs at least 2 classes in the train split, got {len(np.unique(y))}"
        )
    samples = [(path, int(label), row) for row, (path, label) in enumerate(zip(train_paths, y, strict=True))]
    fit_part, held_part = stratified_split(samples, HOLDOUT_FRACTION, seed=seed)
    fit_rows = np.array([s[2] for s in fit_part])
    held_rows = np.array([s[2] for s in held_part])
    start = time.perf_counter()
    best_c, rows = sweep_c(x[fit_rows], y[fit_rows], x[held_rows], y[held_rows], seed)
    model, converged = fit_logistic(x, y, best_c, seed)
    vx, vy = val["features"].double().numpy(), val["labels"].numpy()
    best = {
        "C": best_c,
        "top1": round(_topk(model, vx, vy, 1), 4),
        "top5": round(_topk(model, vx, vy, min(5, num_classes)), 4),
        "holdout_top1": next(r["holdout_top1"] for r in rows if r["best"]),
        "converged": converged,
    }
    return {
        "solver": "lbfgs",
        "protocol_detail": "CLIP linear probe: sklearn LogisticRegression (L-BFGS, multinomial, L2), C searched "
        f"on a stratified {HOLDOUT_FRACTION:.0%} of train over 1e{C_RANGE[0]:g}..1e{C_RANGE[1]:g} "
        f"to {STEPS_PER_DECADE} steps per decade, refit on all of train",
        "max_iter": MAX_ITER,
        "holdout_fraction": HOLDOUT_FRACTION,
        "num_fit": int(len(fit_rows)),
        "num_holdout": int(len(held_rows)),
        "per_C": rows,
        "best": best,
        "num_classes": num_classes,
        "feature_dim": int(x.shape[1]),
        "seconds_fit": round(time.perf_counter() - start, 3),
        "c_at_edge": math.isclose(math.log10(best_c), C_RANGE[0])
        or math.isclose(math.log10(best_c), C_RANGE[1]),
    }
