from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ssl_xcit.visualize.neighbours import find_neighbours, neighbours_figure, panel_titles


def _brute_force(bank, queries, k):
    sims = F.normalize(queries, dim=1) @ F.normalize(bank, dim=1).T
    return sims.topk(k, dim=1)


def test_grid_labels_equal_the_knn_result():
    torch.manual_seed(0)
    bank, queries = torch.randn(30, 16), torch.randn(3, 16)
    labels = [f"c{i % 4}" for i in range(30)]
    paths = [Path(f"b{i}.jpg") for i in range(30)]
    result = find_neighbours(bank, paths, labels, queries, [Path("q.jpg")] * 3, ["c1", "c2", None], k=5)
    sims, idx = _brute_force(bank, queries, 5)
    assert torch.equal(result.indices, idx)
    for q in range(3):
        titles = panel_titles(result, q)
        expected = [labels[int(i)] for i in idx[q]]
        assert [t.split()[0] for t, _ in titles] == expected
        assert [float(t.split()[1]) for t, _ in titles] == [round(float(s), 3) for s in sims[q]]
        truth = result.query_labels[q]
        assert [wrong for _, wrong in titles] == [truth is not None and e != truth for e in expected]
        assert all(t.endswith("✗") == wrong for t, wrong in titles)


def test_figure_draws_the_titles(shared_data):
    roses = sorted((shared_data / "flowers5" / "rose").glob("*.jpg"))[:3]
    tulips = sorted((shared_data / "flowers5" / "tulip").glob("*.jpg"))[:3]
    bank = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    result = find_neighbours(
        bank,
        roses[:2] + tulips[:2],
        ["rose", "rose", "tulip", "tulip"],
        torch.tensor([[1.0, 0.05]]),
        [roses[2]],
        ["tulip"],
        k=3,
    )
    fig = neighbours_figure(result, size=32)
    drawn = [ax.get_title() for ax in fig.axes]
    # q = (1, 0.05) normalised; by hand: cos to (1, 0) = 0.99875, (0.9, 0.1) = 0.99814, (0.1, 0.9) = 0.15991
    assert drawn == ["query: tulip", "rose 0.999 ✗", "rose 0.998 ✗", "tulip 0.160"]
    assert [ax.title.get_color() for ax in fig.axes[1:]] == ["red", "red", "black"]
