"""Training curves of a DINO run from its Lightning ``CSVLogger`` file, with collapse regions shaded.

DINO collapses in two ways (Caron et al. 2021, section 5.3 and figure 7), both visible in two logged numbers,
``train/teacher_entropy`` H (mean entropy of the teacher's per-image distribution) and ``train/kl_to_uniform``
(KL between the batch-mean teacher distribution and uniform), with K = ``out_dim`` prototypes:

* uniform: every image gets the uniform distribution, H near ln K and KL near 0;
* one prototype: every image puts its mass on the same prototype, H near 0 and KL near ln K. (A low H alone
  is a sharp, healthy teacher when the images use different prototypes, so KL is required too.)

A run with iBOT's masked patch term also logs ``train/ibot_loss``, ``train/ibot_teacher_entropy`` and
``train/ibot_kl_to_uniform``; the figure then gets a third row for them, with the patch term's own collapse
regions (its K is ``ibot_out_dim``, else ``out_dim``).
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
PATCH_PANELS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("train/ibot_loss",), "iBOT patch loss"),
    (("train/ibot_teacher_entropy",), "patch teacher entropy (nats)"),
    (("train/ibot_kl_to_uniform",), "KL(mean patch teacher || uniform) (nats)"),
)
# The signal columns of each term: (entropy, KL).
SIGNALS = {
    "dino": ("train/teacher_entropy", "train/kl_to_uniform"),
    "ibot": ("train/ibot_teacher_entropy", "train/ibot_kl_to_uniform"),
}
# "Near" as fractions of ln K: loose enough for the noise of a batch estimate, far from a healthy run.
NEAR_FRACTION = 0.1


@dataclass
class RunMetrics:
    """Logged series by column name: ``(steps, values)`` with the NaN rows of that column dropped."""

    path: Path
    series: dict[str, tuple[np.ndarray, np.ndarray]]
    out_dim: int | None
    ibot_out_dim: int | None = None


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


def _out_dim(metrics: Path, key: str = "out_dim") -> int | None:
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
        if isinstance(source, dict) and isinstance(source.get(key), int):
            return source[key]
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
    out_dim = out_dim if out_dim is not None else _out_dim(path)
    ibot_out_dim = _out_dim(path, "ibot_out_dim") or out_dim
    return RunMetrics(path, series, out_dim, ibot_out_dim)


def collapse_regions(metrics: RunMetrics, term: str = "dino") -> dict[str, list[tuple[float, float]]]:
    """Step intervals of each collapse kind (``uniform``, ``one prototype``) of a term (``dino`` or the
    ``ibot`` patch term); empty without its entropy, KL or K."""
    h = metrics.series.get(SIGNALS[term][0])
    kl = metrics.series.get(SIGNALS[term][1])
    out_dim = metrics.out_dim if term == "dino" else metrics.ibot_out_dim
    if h is None or kl is None or not out_dim:
        return {"uniform": [], "one prototype": []}
    log_k = math.log(out_dim)
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
    """Six panels (loss, lr, teacher temperature, k-NN, entropy, KL) over steps, plus iBOT's three when logged;
    each term's collapse regions shaded on its panels."""
    import matplotlib.pyplot as plt

    panels = list(PANELS)
    if any(columns[0] in metrics.series for columns, _ in PATCH_PANELS):
        panels += PATCH_PANELS
    terms = {"dino": collapse_regions(metrics), "ibot": collapse_regions(metrics, "ibot")}
    fig, axes = plt.subplots(len(panels) // 3, 3, figsize=(12, 3 * len(panels) // 3))
    drawn = 0
    for ax, (columns, title) in zip(axes.ravel(), panels, strict=True):
        regions = terms["ibot" if columns[0].startswith("train/ibot") else "dino"]
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
        k = {"train/teacher_entropy": metrics.out_dim, "train/ibot_teacher_entropy": metrics.ibot_out_dim}
        if k.get(column):
            ax.axhline(math.log(k[column]), color="grey", ls="--", lw=0.8, label=f"ln K = ln {k[column]}")
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
