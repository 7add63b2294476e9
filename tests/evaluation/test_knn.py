"""Weighted k-NN: exact values on constructed cases, a plain-loop reference, and backend equivalence."""

from __future__ import annotations

import math

import pytest
import torch

from ssl_xcit.evaluation.knn import knn_accuracy, weighted_knn

T = 0.07


def reference_knn(train, train_labels, queries, query_labels, k, temperature, num_classes):
    """DINO's weighted k-NN written as plain Python loops: (top1 %, top5 %, per-query class scores)."""
    top1 = top5 = 0
    all_scores = []
    for q, label in zip(queries.tolist(), query_labels.tolist(), strict=True):
        qn = math.sqrt(sum(v * v for v in q))
        sims = []
        for j, t in enumerate(train.tolist()):
            tn = math.sqrt(sum(v * v for v in t))
            sims.append((sum(a * b for a, b in zip(q, t, strict=True)) / (qn * tn), j))
        sims.sort(reverse=True)
        scores = [0.0] * num_classes
        for sim, j in sims[:k]:
            scores[int(train_labels[j])] += math.exp(sim / temperature)
        ranked = sorted(range(num_classes), key=lambda c: -scores[c])
        top1 += ranked[0] == label
        top5 += label in ranked[: min(5, k, num_classes)] and scores[label] > 0
        all_scores.append(scores)
    n = len(query_labels)
    return 100.0 * top1 / n, 100.0 * top5 / n, torch.tensor(all_scores, dtype=torch.float64)


@pytest.fixture
def random_problem():
    g = torch.Generator().manual_seed(1)
    num_classes = 7
    train = torch.randn(120, 16, generator=g)
    train_labels = torch.randint(0, num_classes, (120,), generator=g)
    # Queries near some train points, so accuracies are far from both 0 and 100.
    queries = train[:45] + 0.9 * torch.randn(45, 16, generator=g)
    query_labels = torch.where(
        torch.rand(45, generator=g) < 0.6, train_labels[:45], torch.randint(0, 7, (45,), generator=g)
    )
    return train, train_labels, queries, query_labels, num_classes


def test_constructed_two_class_votes_are_exact():
    # Bank: two class-0 vectors along x, one class-1 vector along y. Query at 30 degrees from x.
    train = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 3.0]])
    labels = torch.tensor([0, 0, 1])
    angle = math.radians(30)
    query = torch.tensor([[math.cos(angle), math.sin(angle)]]) * 5.0  # norm must not matter
    cos_x, cos_y = math.cos(angle), math.sin(angle)
    scores = weighted_knn(train, labels, query, ks=(1, 2, 3), temperature=T)
    assert scores[1].tolist()[0] == pytest.approx([math.exp(cos_x / T), 0.0], rel=1e-5)
    assert scores[2].tolist()[0] == pytest.approx([2 * math.exp(cos_x / T), 0.0], rel=1e-5)
    assert scores[3].tolist()[0] == pytest.approx([2 * math.exp(cos_x / T), math.exp(cos_y / T)], rel=1e-5)
    # Two queries: one nearer class 1 and labelled 1 (right), one labelled 1 but nearer class 0 (wrong).
    queries = torch.tensor([[0.1, 1.0], [1.0, 0.2]])
    acc = knn_accuracy(train, labels, queries, torch.tensor([1, 1]), ks=(1, 3), temperature=T)
    assert acc[1]["top1"] == 50.0 and acc[3]["top1"] == 50.0
    # top-min(5, k, C): with k = 1 only the best class counts, with 2 classes both do.
    assert acc[1]["top5"] == 50.0 and acc[3]["top5"] == 100.0
    assert acc[3]["k"] == 3 and acc[3]["temperature"] == T and acc[3]["num_classes"] == 2


def test_temperature_changes_the_vote():
    # One class-1 neighbour slightly closer than two class-0 ones: a low T lets it win, a high T does not.
    train = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    labels = torch.tensor([0, 0, 1])
    query = torch.tensor([[0.6, 0.8]])  # cos 0.6 to class 0, 0.8 to class 1
    low = weighted_knn(train, labels, query, ks=(3,), temperature=0.07)[3][0]
    high = weighted_knn(train, labels, query, ks=(3,), temperature=10.0)[3][0]
    assert low.argmax() == 1 and high.argmax() == 0
    assert low[1] / low[0] == pytest.approx(math.exp(0.8 / 0.07) / (2 * math.exp(0.6 / 0.07)), rel=1e-5)


@pytest.mark.parametrize("backend", ["torch", "faiss"])
def test_random_features_match_plain_reference(random_problem, backend):
    train, train_labels, queries, query_labels, num_classes = random_problem
    ks = (1, 5, 10, 20, 100)
    acc = knn_accuracy(train, train_labels, queries, query_labels, ks=ks, temperature=T, backend=backend)
    scores = weighted_knn(train, train_labels, queries, ks=ks, temperature=T, backend=backend)
    for k in ks:
        ref_top1, ref_top5, ref_scores = reference_knn(
            train, train_labels, queries, query_labels, k, T, num_classes
        )
        assert acc[k]["top1"] == pytest.approx(ref_top1)
        assert acc[k]["top5"] == pytest.approx(ref_top5)
        torch.testing.assert_close(scores[k].double(), ref_scores, rtol=1e-4, atol=1e-3)
    # Not a degenerate case: accuracies are neither 0 nor 100, and top-5 grows with k.
    assert 0 < acc[10]["top1"] < 100 and acc[1]["top5"] < acc[100]["top5"] < 100


def test_torch_and_faiss_agree_on_larger_random_bank():
    g = torch.Generator().manual_seed(2)
    train = torch.randn(3000, 64, generator=g)
    labels = torch.randint(0, 50, (3000,), generator=g)
    queries = train[:500] + 0.5 * torch.randn(500, 64, generator=g)
    qlabels = labels[:500]
    a = knn_accuracy(train, labels, queries, qlabels, backend="torch")
    b = knn_accuracy(train, labels, queries, qlabels, backend="faiss")
    for k in (10, 20, 100, 200):
        assert a[k]["top1"] == b[k]["top1"] and a[k]["top5"] == b[k]["top5"]
    assert a[20]["top1"] > 50  # queries are noisy copies of bank points: far above 2 % chance


@pytest.mark.parametrize("chunk_size", [1, 3, 7, None, 10_000])
def test_chunking_does_not_change_results(random_problem, chunk_size):
    # The reference's N // 100 chunking crashes below 100 queries; any chunk size must give the same scores.
    train, train_labels, queries, query_labels, _ = random_problem
    base = weighted_knn(train, train_labels, queries[:5], ks=(10,), temperature=T, chunk_size=None)
    got = weighted_knn(train, train_labels, queries[:5], ks=(10,), temperature=T, chunk_size=chunk_size)
    # exp(sim / 0.07) turns a 1-ulp difference of a matrix-vector vs matrix-matrix product into ~2e-6 relative.
    torch.testing.assert_close(got[10], base[10], rtol=1e-5, atol=0)


def test_num_classes_comes_from_the_data():
    train = torch.randn(10, 4)
    labels = torch.tensor([0, 1, 2] * 3 + [12])
    scores = weighted_knn(train, labels, torch.randn(2, 4), ks=(3,))
    assert scores[3].shape == (2, 13)
    acc = knn_accuracy(train, labels % 3, torch.randn(2, 4), torch.tensor([0, 40]), ks=(3,))
    assert acc[3]["num_classes"] == 41


def test_k_larger_than_bank_is_clamped_with_a_warning(random_problem):
    train, train_labels, queries, query_labels, num_classes = random_problem
    with pytest.warns(UserWarning, match=r"k=500 is larger than the bank \(120 train features\)"):
        acc = knn_accuracy(train, train_labels, queries, query_labels, ks=(10, 500), temperature=T)
    assert acc[500]["k"] == 500 and acc[500]["k_effective"] == 120
    ref_top1, _, _ = reference_knn(train, train_labels, queries, query_labels, 120, T, num_classes)
    assert acc[500]["top1"] == pytest.approx(ref_top1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_matches_cpu(random_problem):
    train, train_labels, queries, query_labels, _ = random_problem
    cpu = knn_accuracy(train, train_labels, queries, query_labels)
    gpu = knn_accuracy(train.cuda(), train_labels.cuda(), queries.cuda(), query_labels)
    assert {k: v["top1"] for k, v in cpu.items()} == {k: v["top1"] for k, v in gpu.items()}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": 0.0}, "temperature must be a positive number"),
        ({"backend": "annoy"}, "unknown k-NN backend 'annoy'; valid backends: torch, faiss"),
        ({"ks": ()}, "ks is empty"),
        ({"ks": (0,)}, "k must be a positive integer, got 0"),
    ],
)
def test_bad_parameters(random_problem, kwargs, match):
    train, train_labels, queries, query_labels, _ = random_problem
    with pytest.raises(ValueError, match=match):
        knn_accuracy(train, train_labels, queries, query_labels, **{"ks": (10,), **kwargs})


def test_bad_features():
    with pytest.raises(ValueError, match="train_features is empty"):
        weighted_knn(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), torch.randn(2, 4))
    with pytest.raises(ValueError, match="differ in dimension: 4 vs 5"):
        weighted_knn(torch.randn(3, 4), torch.tensor([0, 1, 0]), torch.randn(2, 5))
    with pytest.raises(ValueError, match="unlabelled"):
        weighted_knn(torch.randn(3, 4), torch.tensor([0, -1, 0]), torch.randn(2, 4))
    with pytest.raises(ValueError, match="3 train features but 2 train labels"):
        weighted_knn(torch.randn(3, 4), torch.tensor([0, 1]), torch.randn(2, 4))
