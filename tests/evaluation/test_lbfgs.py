"""``linear --solver lbfgs``: exact accuracies on constructed features, and scikit-learn called directly agrees."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression

from ssl_xcit.cli import main
from ssl_xcit.errors import UserError
from ssl_xcit.evaluation.cached import split_features
from ssl_xcit.evaluation.features import FeatureConfig
from ssl_xcit.evaluation.linear.lbfgs import C_RANGE, STEPS_PER_DECADE, lbfgs_probe, sweep_c
from ssl_xcit.evaluation.pipeline import load_split_datasets
from ssl_xcit.evaluation.report import format_linear_table

from .helpers import ARCH, CROP, RESIZE, small_args


def _clusters(per_class: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three classes, each a tight cloud around its own corner: linearly separable with a wide margin."""
    g = torch.Generator().manual_seed(seed)
    centres = 10.0 * torch.eye(3, 8)
    labels = torch.arange(3).repeat_interleave(per_class)
    return centres[labels] + 0.1 * torch.randn(len(labels), 8, generator=g), labels


def _split(features, labels, prefix):
    return {"features": features, "labels": labels}, [f"{prefix}/{i:03d}.jpg" for i in range(len(labels))]


def test_separable_classes_are_all_right_and_planted_mistakes_are_exactly_wrong():
    train, paths = _split(*_clusters(10, seed=0), "train")
    x, y = _clusters(4, seed=1)
    y = y.clone()
    y[[0, 5]] = torch.tensor([2, 0])  # two val images labelled as a class they are far from: 2 of 12 wrong
    results = lbfgs_probe(train, {"features": x, "labels": y}, paths, num_classes=3)
    assert results["best"]["top1"] == pytest.approx(100.0 * 10 / 12, abs=1e-4)
    assert results["best"]["top5"] == 100.0  # top-3 of 3 classes
    assert results["num_fit"] + results["num_holdout"] == 30 and results["num_holdout"] == 6  # 2 per class
    clean = lbfgs_probe(train, {"features": x, "labels": _clusters(4, 1)[1]}, paths, num_classes=3)
    assert clean["best"]["top1"] == 100.0


def test_the_search_is_clips_coarse_grid_refined_to_eight_steps_per_decade():
    x, y = _clusters(10, seed=0)
    rng = np.random.default_rng(0)
    noisy = x.numpy() + rng.normal(0, 8.0, x.shape)  # overlapping classes: C matters
    best_c, rows = sweep_c(noisy[::2], y.numpy()[::2], noisy[1::2], y.numpy()[1::2])
    exponents = [np.log10(r["C"]) for r in rows]
    coarse = np.arange(C_RANGE[0], C_RANGE[1] + 1, 2.0)
    assert all(np.isclose(exponents, e).any() for e in coarse)
    assert all(np.isclose(e * STEPS_PER_DECADE, round(e * STEPS_PER_DECADE)) for e in exponents)
    assert len(rows) <= len(coarse) + 2 * 4 and exponents == sorted(exponents)
    chosen = max(rows, key=lambda r: (r["holdout_top1"], -r["holdout_loss"]))
    assert chosen["C"] == best_c and [r["best"] for r in rows].count(True) == 1 and chosen["best"]
    # the held-out accuracy of a row is sklearn's own score of that fit
    direct = LogisticRegression(C=best_c, solver="lbfgs", max_iter=1000).fit(noisy[::2], y.numpy()[::2])
    assert chosen["holdout_top1"] == pytest.approx(
        100.0 * direct.score(noisy[1::2], y.numpy()[1::2]), abs=1e-4
    )


@pytest.fixture(scope="module")
def small_split(flowers_split, tmp_path_factory):
    """10 train and 4 val photos per class of the flowers split: L-BFGS's slow large-C fits stay short."""
    root = tmp_path_factory.mktemp("lbfgs_split")
    for split, source, n in (("train", flowers_split[0], 10), ("val", flowers_split[1], 4)):
        for folder in sorted(source.iterdir()):
            (root / split / folder.name).mkdir(parents=True)
            for path in sorted(folder.iterdir())[:n]:
                (root / split / folder.name / path.name).symlink_to(path.resolve())
    return root / "train", root / "val"


def test_cli_lbfgs_predicts_what_sklearn_predicts_on_the_cached_features(small_split, tmp_path, capsys):
    train, val = small_split
    results = main(["linear", *small_args(train, val, tmp_path / "cache"), "--solver", "lbfgs"])
    table = capsys.readouterr().out
    assert "L-BFGS logistic regression" in table and f"top1 {results['best']['top1']:.2f}" in table
    train_ds, val_ds = load_split_datasets(train, val, _eval())
    (tr, tr_hit), (va, va_hit), _ = split_features(
        train_ds, val_ds, weights=None, arch=ARCH, config=FeatureConfig(), cache_dir=tmp_path / "cache",
        batch_size=64, num_workers=0, accelerator="cpu", devices=1, progress=False,
    )  # fmt: skip
    assert tr_hit and va_hit  # the features the probe was fitted on
    C = results["best"]["C"]
    direct = LogisticRegression(C=C, solver="lbfgs", max_iter=1000, random_state=0)
    direct.fit(tr["features"].double().numpy(), tr["labels"].numpy())
    predicted = direct.predict(va["features"].double().numpy())
    top1 = 100.0 * float((predicted == va["labels"].numpy()).mean())
    assert results["best"]["top1"] == pytest.approx(top1, abs=1e-4)
    assert results["num_train"] == 50 and results["num_val"] == 20 and results["num_holdout"] == 10


def _eval():
    from ssl_xcit.data.transforms import eval_transform

    return eval_transform(resize=RESIZE, crop=CROP)


def test_lbfgs_refuses_sgd_learning_rates(flowers_split, tmp_path):
    train, val = flowers_split
    with pytest.raises(UserError, match="--solver lbfgs sweeps C itself, so drop --lrs"):
        main(["linear", *small_args(train, val, tmp_path), "--solver", "lbfgs", "--lrs", "0.1"])


def test_lbfgs_table_marks_the_best_c_and_an_edge():
    rows = [
        {"C": 1e-6, "holdout_top1": 40.0, "holdout_loss": 1.0, "best": True, "converged": True},
        {"C": 1e-4, "holdout_top1": 30.0, "holdout_loss": 1.1, "best": False, "converged": True},
    ]
    results = {"mode": "lbfgs", "feature": "cls1", "num_holdout": 6, "num_train": 30, "per_C": rows,
               "best": {"C": 1e-6, "top1": 50.0, "top5": 100.0, "converged": False}, "c_at_edge": True}  # fmt: skip
    lines = format_linear_table(results).splitlines()
    assert lines[2].split() == ["1e-06", "40.00", "*"] and lines[3].split() == ["0.0001", "30.00"]
    assert lines[4] == "val at C 1e-06 (refit on all 30 train images): top1 50.00  top5 100.00"
    assert "edge of the searched range" in lines[5] and "iteration limit" in lines[6]
