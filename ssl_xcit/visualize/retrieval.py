"""Ranked lists of a retrieval run: each query with its top-10, every result marked against the ground truth.

Ranks come from :func:`ssl_xcit.retrieval.run_retrieval` (so its descriptor cache is reused: a second picture of
the same run extracts nothing) or from the JSON a ``ssl-xcit retrieval --output`` run wrote (``top_ranks``).
Marks follow the benchmark's protocol: positive, junk (ignored by the metric) or negative; on the revisited
datasets (ROxford/RParis) per setup, Easy, Medium and Hard.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ssl_xcit.retrieval import RetrievalDataset, load_dataset
from ssl_xcit.visualize.common import VisualizeError, read_image

POSITIVE, JUNK, NEGATIVE = "positive", "junk", "negative"
SETUPS = ("easy", "medium", "hard")
COLOURS = {POSITIVE: "limegreen", JUNK: "orange", NEGATIVE: "red"}


def relevant(dataset: RetrievalDataset, q: int, setup: str = "medium") -> tuple[set[int], set[int]]:
    """``(positives, junk)`` database indices of query ``q`` under the dataset's protocol.

    Revisited setups (Radenovic et al. 2018): Easy counts easy images positive and hard ones junk; Medium counts
    both positive; Hard counts hard ones positive and easy ones junk. Elsewhere the query itself, when it is in
    the database, is junk (it is removed from its own ranking by the metric).
    """
    g = dataset.gnd[q]
    if dataset.protocol == "revisited":
        if setup not in SETUPS:
            raise VisualizeError(f"unknown revisited setup {setup!r}; valid: {', '.join(SETUPS)}")
        easy, hard, junk = (set(map(int, g[key])) for key in ("easy", "hard", "junk"))
        return {
            "easy": (easy, junk | hard),
            "medium": (easy | hard, junk),
            "hard": (hard, junk | easy),
        }[setup]
    junk = set(map(int, g.get("junk", [])))
    own = dataset.query_db_index[q]
    if own is not None:
        junk.add(int(own))
    return set(map(int, g["ok"])) - junk, junk


def marks(dataset: RetrievalDataset, q: int, ranked: list[int], setup: str = "medium") -> list[str]:
    """positive / junk / negative for each ranked database index of query ``q``."""
    positives, junk = relevant(dataset, q, setup)
    return [POSITIVE if i in positives else JUNK if i in junk else NEGATIVE for i in map(int, ranked)]


def load_results(path: str | os.PathLike) -> tuple[RetrievalDataset, list[list[int]], dict]:
    """The dataset and ``top_ranks`` of a results JSON written by ``ssl-xcit retrieval --output``."""
    path = Path(path)
    if not path.is_file():
        raise VisualizeError(f"retrieval results file not found: {path}")
    try:
        result = json.loads(path.read_text())
        config = result["config"]
        ranks = result["top_ranks"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise VisualizeError(
            f"{path} is not a results JSON of `ssl-xcit retrieval --output` (missing {error})"
        ) from error
    dataset = load_dataset(
        config["dataset"],
        config["data_root"],
        crop_queries=config.get("crop_queries", True),
        gnd_path=config.get("gnd"),
        rotations=config.get("rotations"),
    )
    return dataset, ranks, result


def _thumb(path: Path, bbx, size: int) -> np.ndarray:
    image = read_image(path)
    if bbx is not None:
        image = image.crop(tuple(int(round(v)) for v in bbx))
    image.thumbnail((size, size))
    return np.asarray(image)


def retrieval_figure(
    dataset: RetrievalDataset,
    ranks: list[list[int]],
    queries: list[int] | None = None,
    top: int = 10,
    setup: str = "medium",
    size: int = 96,
):
    """One row per query: the query (its box, when cropped), then its ``top`` results, border = mark.

    Returns ``(figure, marks)`` with ``marks[row]`` the drawn marks; revisited titles show all three setups.
    """
    import matplotlib.pyplot as plt

    queries = list(range(len(ranks))) if queries is None else list(queries)
    bad = [q for q in queries if not 0 <= q < len(ranks)]
    if bad:
        raise VisualizeError(f"query indices {bad} out of range: the run has {len(ranks)} queries")
    revisited = dataset.protocol == "revisited"
    top = min(top, min(len(ranks[q]) for q in queries))
    fig, axes = plt.subplots(
        len(queries), top + 1, figsize=(1.4 * (top + 1), 1.6 * len(queries)), squeeze=False
    )
    drawn = []
    for row, q in enumerate(queries):
        ranked = [int(i) for i in ranks[q][:top]]
        row_marks = marks(dataset, q, ranked, setup)
        drawn.append(row_marks)
        per_setup = {s: marks(dataset, q, ranked, s) for s in SETUPS} if revisited else {}
        axes[row, 0].imshow(_thumb(dataset.queries[q], dataset.query_bbx[q], size))
        axes[row, 0].set_title(f"query {q}", fontsize=7, fontweight="bold")
        for c, i in enumerate(ranked, start=1):
            ax = axes[row, c]
            ax.imshow(_thumb(dataset.database[i], None, size))
            title = f"{c}: {row_marks[c - 1]}"
            if revisited:
                title = f"{c}: " + " ".join(
                    f"{s[0].upper()}{'+j-'[[POSITIVE, JUNK, NEGATIVE].index(per_setup[s][c - 1])]}"
                    for s in SETUPS
                )
            ax.set_title(
                title,
                fontsize=6,
                color=COLOURS[row_marks[c - 1]] if row_marks[c - 1] != JUNK else "darkorange",
            )
        for ax, mark in zip(axes[row], [None, *row_marks], strict=True):
            ax.set_xticks([])
            ax.set_yticks([])
            for spine in ax.spines.values():
                spine.set_color(COLOURS.get(mark, "black"))
                spine.set_linewidth(3 if mark else 0.5)
    legend = "green = positive, orange = junk, red = negative"
    if revisited:
        legend += f" ({setup} setup; titles: E/M/H setup with + positive, j junk, - negative)"
    fig.suptitle(f"{dataset.name}: top-{top} per query; {legend}", fontsize=8)
    fig.tight_layout()
    return fig, drawn
