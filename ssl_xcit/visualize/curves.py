"""Training curves of a DINO run from its Lightning ``CSVLogger`` file, with collapse regions shaded.

DINO collapses in two ways (Caron et al. 2021, section 5.3 and figure 7), both visible in two logged numbers,
``train/teacher_entropy`` H (mean entropy of the teacher's per-image distribution) and ``train/kl_to_uniform``
(KL between the batch-mean teacher distribution and uniform), with K = ``out_dim`` prototypes:

* uniform: every image gets the uniform distribution, H near ln K and KL near 0;
* one prototype: every image puts its mass on the same prototype, H near 0 and KL near ln K. (A low H alone
  is a sharp, healthy teacher when the images use different prototypes, so KL is required too.)
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ssl_xcit.visualize.common import VisualizeError

# (column, panel title); the first existing column of each alternatives tuple is drawn.
PANELS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("train/loss_step", "train/loss"), "DINO loss"),
    (("train/lr",), "learning rate"),
    (("train/teacher_temp",), "teacher temperature"),
    (("knn/top1",), "online k-NN top-1 (%)"),
    (("train/teacher_entropy",), "teacher entropy (nats)"),
    (("train/kl_to_uniform",), "KL(mean teacher || uniform) (nats)"),
)
# "Near" as fractions of ln K: loose enough for the noise of a batch estimate, far from a healthy run.
NEAR_FRACTION = 0.1


@dataclass
class RunMetrics:
    """Logged series by column name: ``(steps, values)`` with the NaN rows of that column dropped."""

    path: Path
    series: dict[str, tuple[np.ndarray, np.ndarray]]
    out_dim: int | None


def find_metrics(run: str | os.PathLike) -> Path:
    """The ``metrics.csv`` of a run: the file itself, or the newest one under the directory."""
    run = Path(run)
    if run.is_file():
        return run
    if not run.is_dir():
        raise VisualizeError(f"run directory not found: {run}")
    found = sorted(run.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise VisualizeError(
            f"no metrics.csv under {run}: curves need a run logged with Lightning's CSVLogger "
            "(recipes/quickstart.yaml adds one)"
        )
    return found[-1]


def _out_dim(metrics: Path) -> int | None:
    hparams = metrics.parent / "hparams.yaml"
    if not hparams.is_file():
        return None
    import yaml

    data = yaml.safe_load(hparams.read_text()) or {}
    for source in (
        data,
        data.get("model", {}) or {},
        (data.get("model", {}) or {}).get("init_args", {}) or {},
    ):
        if isinstance(source, dict) and isinstance(source.get("out_dim"), int):
            return source["out_dim"]
    return None


def read_metrics(run: str | os.PathLike, out_dim: int | None = None) -> RunMetrics:
    """Every numeric column of the run's ``metrics.csv``; ``out_dim`` defaults to the run's ``hparams.yaml``."""
    path = find_metrics(run)
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise VisualizeError(f"cannot read metrics file {path}: {error}") from error
    if not rows or "step" not in rows[0]:
        raise VisualizeError(f"metrics file {path} has no rows or no 'step' column")
    series = {}
    for column in rows[0]:
        if column in ("step", "epoch"):
            continue
        pairs = [
            (float(r["step"]), float(r[column]))
            for r in rows
            if r.get(column) not in (None, "") and r["step"]
        ]
        if pairs:
            steps, values = np.array(pairs).T
            series[column] = (steps, values)
    return RunMetrics(path, series, out_dim if out_dim is not None else _out_dim(path))


def collapse_regions(metrics: RunMetrics) -> dict[str, list[tuple[float, float]]]:
    """Step intervals of each collapse kind (``uniform``, ``one prototype``); empty without entropy, KL or K."""
    h = metrics.series.get("train/teacher_entropy")
    kl = metrics.series.get("train/kl_to_uniform")
    if h is None or kl is None or not metrics.out_dim:
        return {"uniform": [], "one prototype": []}
    log_k = math.log(metrics.out_dim)
    steps, hv = h
    kl_at = np.interp(steps, *kl)
    near = NEAR_FRACTION * log_k
    flags = {
        "uniform": (hv > log_k - near) & (kl_at < near),
        "one prototype": (hv < near) & (kl_at > log_k - near),
    }
    out = {}
    for kind, flag in flags.items():
        spans, start = [], None
        for i, on in enumerate(flag):
            if on and start is None:
                start = i
            if start is not None and (not on or i == len(flag) - 1):
                end = i if on else i - 1
                spans.append((float(steps[start]) - 0.5, float(steps[end]) + 0.5))
                start = None
        out[kind] = spans
    return out


def curves_figure(metrics: RunMetrics):
    """Six panels (loss, lr, teacher temperature, k-NN, entropy, KL) over steps; collapse regions shaded."""
    import matplotlib.pyplot as plt

    regions = collapse_regions(metrics)
    fig, axes = plt.subplots(2, 3, figsize=(12, 6))
    drawn = 0
    for ax, (columns, title) in zip(axes.ravel(), PANELS, strict=True):
        column = next((c for c in columns if c in metrics.series), None)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        if column is None:
            ax.text(0.5, 0.5, f"{columns[0]} not logged", ha="center", va="center", transform=ax.transAxes)
            continue
        steps, values = metrics.series[column]
        ax.plot(steps, values, marker="o" if len(steps) < 20 else None, markersize=3)
        drawn += 1
        for kind, colour in (("uniform", "tab:orange"), ("one prototype", "tab:red")):
            for i, (a, b) in enumerate(regions[kind]):
                ax.axvspan(a, b, color=colour, alpha=0.2, label=f"collapse: {kind}" if i == 0 else None)
        if metrics.out_dim and column == "train/teacher_entropy":
            ax.axhline(
                math.log(metrics.out_dim), color="grey", ls="--", lw=0.8, label=f"ln K = ln {metrics.out_dim}"
            )
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if drawn == 0:
        plt.close(fig)
        raise VisualizeError(
            f"{metrics.path} holds none of the DINO columns ({', '.join(c[0] for c, _ in PANELS)})"
        )
    fig.suptitle(
        f"training curves: {metrics.path.parent.parent.name}/{metrics.path.parent.name}/metrics.csv",
        fontsize=9,
    )
    fig.tight_layout()
    return fig
