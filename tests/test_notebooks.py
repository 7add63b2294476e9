"""Every notebook's code runs top to bottom (executed as plain Python, from the notebooks/ folder)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import pytest
import torch

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch, shared_data):
    matplotlib.use("Agg")
    monkeypatch.chdir(path.parent)
    cells = json.loads(path.read_text())["cells"]
    namespace: dict = {}
    for cell in cells:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{path.name}", "exec"), namespace)  # noqa: S102
    import matplotlib.pyplot as plt

    plt.close("all")
    if path.stem == "attention_maps":
        maps = namespace["maps"]
        assert maps.shape == (1, 4, 224, 224)
    if path.stem == "pca_features":
        assert [rgb.shape for rgb in namespace["pictures"].rgb] == [(14, 14, 3)] * 3
    if path.stem == "nearest_neighbours":
        from ssl_xcit.evaluation.knn import knn_search

        result = namespace["result"]
        _, idx = next(knn_search(namespace["bank"], namespace["queries"], 5))
        assert torch.equal(result.indices, idx)
    if path.stem == "retrieval_ranking":
        from ssl_xcit.visualize.retrieval import marks

        dataset, ranks = namespace["dataset"], namespace["result"]["top_ranks"]
        assert namespace["marks"] == [marks(dataset, q, ranks[q][:6]) for q in (0, 4, 8)]
    if path.stem == "training_curves":
        assert "train/teacher_entropy" in namespace["metrics"].series
