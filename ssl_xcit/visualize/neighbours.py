"""Nearest training images of chosen queries under the k-NN protocol (cosine on ``forward``, top-k).

The search is :func:`ssl_xcit.evaluation.knn.knn_search`, the very code the k-NN evaluation votes with, so the
picture shows exactly the neighbours that vote. Each neighbour is titled with its label and similarity; a label
other than the query's is drawn in red with a cross.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from ssl_xcit.data.datasets import scan_folder
from ssl_xcit.evaluation.knn import knn_search
from ssl_xcit.visualize.common import VisualizeError, prepare, progress, read_image


@dataclass
class Neighbours:
    """The k-NN result the grid shows: per query, the bank indices, similarities and labels of its neighbours."""

    query_paths: list[Path]
    query_labels: list[str | None]
    bank_paths: list[Path]
    bank_labels: list[str]
    indices: Tensor  # (Q, k) bank indices, most similar first
    similarities: Tensor  # (Q, k) cosine similarities

    def labels(self, q: int) -> list[str]:
        return [self.bank_labels[int(i)] for i in self.indices[q]]


def labelled_images(root: str | os.PathLike, per_class: int | None = None) -> tuple[list[Path], list[str]]:
    """An ImageFolder tree's ``(paths, class names)``, at most ``per_class`` evenly spaced images per class."""
    root = Path(root)
    if not root.is_dir():
        raise VisualizeError(f"image folder not found: {root}")
    samples, classes = scan_folder(root, labelled=True)
    paths, labels = [], []
    for y, name in enumerate(classes or []):
        mine = [p for p, label in samples if label == y]
        if per_class is not None and len(mine) > per_class:
            mine = [mine[i] for i in np.linspace(0, len(mine) - 1, per_class).round().astype(int)]
        paths += mine
        labels += [name] * len(mine)
    return paths, labels


@torch.no_grad()
def embed(
    model: nn.Module,
    paths: Sequence[str | os.PathLike],
    size: int = 224,
    batch_size: int = 32,
    show_progress: bool = True,
) -> Tensor:
    """The global embeddings ``model(x)`` (N, embed_dim) of square-resized images, in batches."""
    model.eval()
    out = []
    chunks = range(0, len(paths), batch_size)
    for start in progress(chunks, total=len(chunks), desc="embedding", enabled=show_progress):
        batch = torch.stack(
            [
                prepare(read_image(p), size, model.size_multiple, square=True)[0]
                for p in paths[start : start + batch_size]
            ]
        )
        out.append(model(batch).float())
    return torch.cat(out)


def find_neighbours(
    bank: Tensor,
    bank_paths: Sequence[Path],
    bank_labels: Sequence[str],
    queries: Tensor,
    query_paths: Sequence[Path],
    query_labels: Sequence[str | None],
    k: int = 8,
) -> Neighbours:
    """Top-``k`` cosine neighbours of every query in the bank, via the k-NN evaluation's search."""
    if k < 1:
        raise VisualizeError(f"k must be a positive integer, got {k}")
    sims, idx = zip(*knn_search(bank, queries, k), strict=True)
    return Neighbours(
        list(query_paths),
        list(query_labels),
        list(bank_paths),
        list(bank_labels),
        torch.cat(idx),
        torch.cat(sims),
    )


def panel_titles(result: Neighbours, q: int) -> list[tuple[str, bool]]:
    """``(title, wrong)`` of each neighbour panel of query ``q``: label and similarity, wrong if labels differ."""
    truth = result.query_labels[q]
    return [
        (
            f"{label} {float(s):.3f}" + (" ✗" if truth is not None and label != truth else ""),
            truth is not None and label != truth,
        )
        for label, s in zip(result.labels(q), result.similarities[q], strict=True)
    ]


def neighbours_figure(result: Neighbours, size: int = 96):
    """One row per query: the query, then its neighbours titled by :func:`panel_titles`."""
    import matplotlib.pyplot as plt

    n_q, k = result.indices.shape
    fig, axes = plt.subplots(n_q, k + 1, figsize=(1.5 * (k + 1), 1.9 * n_q), squeeze=False)
    for q in range(n_q):
        pictures = [result.query_paths[q]] + [result.bank_paths[int(i)] for i in result.indices[q]]
        titles = [(f"query: {result.query_labels[q] or '?'}", False), *panel_titles(result, q)]
        for c, (path, (title, wrong)) in enumerate(zip(pictures, titles, strict=True)):
            ax = axes[q, c]
            ax.imshow(np.asarray(read_image(path).resize((size, size))))
            ax.set_title(
                title,
                fontsize=7,
                color="red" if wrong else "black",
                fontweight="bold" if c == 0 else "normal",
            )
            ax.set_xticks([])
            ax.set_yticks([])
            for spine in ax.spines.values():
                spine.set_color("red" if wrong else "black")
                spine.set_linewidth(2.5 if wrong else 0.5)
    fig.suptitle(f"{k} nearest training images (cosine, k-NN protocol); red = other class", fontsize=9)
    fig.tight_layout()
    return fig
