"""Segmentation scores: exact values on constructed masks, and an independent numpy confusion matrix."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ssl_xcit.evaluation.segmentation.metrics import ConfusionMatrix, scores_from_confusion

IGNORE = 255
# 6 scored pixels (2 ignored). Rows truth: 0 -> [2, 1, 0], 1 -> [0, 1, 1], 2 -> [0, 0, 1].
TARGET = torch.tensor([[0, 0, 0, 1], [1, 2, IGNORE, IGNORE]])
PRED = torch.tensor([[0, 0, 1, 1], [2, 2, 0, 1]])


def _scores(num_classes, *pairs):
    matrix = ConfusionMatrix(num_classes, IGNORE)
    for pred, target in pairs:
        matrix.update(pred, target)
    return matrix.compute(), scores_from_confusion(matrix.compute())


def test_hand_computed_iou_miou_and_pixel_accuracy():
    matrix, s = _scores(3, (PRED, TARGET))
    assert matrix.tolist() == [[2, 1, 0], [0, 1, 1], [0, 0, 1]]
    # IoU = TP / (TP + FP + FN): 2 / 3, 1 / 3, 1 / 2; mIoU their mean, 0.5; pixel accuracy 4 of 6.
    assert s["iou"] == pytest.approx([200 / 3, 100 / 3, 50.0])
    assert s["miou"] == pytest.approx(50.0)
    assert s["pixel_acc"] == pytest.approx(400 / 6)


def test_a_class_in_neither_truth_nor_prediction_is_nan_and_left_out_of_the_mean():
    _, s = _scores(4, (PRED, TARGET))
    assert math.isnan(s["iou"][3])
    assert s["miou"] == pytest.approx(50.0) and s["pixel_acc"] == pytest.approx(400 / 6)


def test_a_class_predicted_but_never_true_scores_zero_and_counts():
    pred = PRED.clone()
    pred[0, 0] = 3  # one pixel of class 0 predicted as class 3, which no target holds
    _, s = _scores(4, (pred, TARGET))
    assert s["iou"] == pytest.approx([100 / 3, 100 / 3, 50.0, 0.0])  # class 0: 1 / (3 + 1 - 1)
    assert s["miou"] == pytest.approx((100 / 3 + 100 / 3 + 50.0 + 0.0) / 4)
    assert s["pixel_acc"] == pytest.approx(300 / 6)


def test_the_split_is_one_matrix_not_a_mean_over_images():
    # Image A: 1 pixel, wrong; image B: 9 pixels, right. Per image the mean would be 50 % accuracy; over the
    # split 9 of 10 pixels are right, and IoU counts them together.
    a_pred, a_true = torch.tensor([1]), torch.tensor([0])
    b_pred = b_true = torch.tensor([0] * 5 + [1] * 4)
    matrix, s = _scores(2, (a_pred, a_true), (b_pred, b_true))
    assert matrix.tolist() == [[5, 1], [0, 4]]
    assert s["pixel_acc"] == pytest.approx(90.0)
    assert s["iou"] == pytest.approx([500 / 6, 400 / 5])


def test_all_ignored_gives_nan_everywhere():
    _, s = _scores(2, (torch.tensor([0, 1]), torch.tensor([IGNORE, IGNORE])))
    assert math.isnan(s["miou"]) and math.isnan(s["pixel_acc"])


def test_random_predictions_match_a_numpy_bincount_confusion_matrix():
    rng = np.random.default_rng(0)
    k, ignore = 7, 9
    images = [(rng.integers(0, k, (h, w)), rng.integers(0, k + 1, (h, w))) for h, w in ((13, 17), (8, 30))]
    for _, target in images:
        target[target == k] = ignore
    matrix, s = _scores_with(k, ignore, images)
    # The reference: one bincount of truth * K + prediction over every labelled pixel of the split.
    pred = np.concatenate([p.ravel() for p, _ in images])
    true = np.concatenate([t.ravel() for _, t in images])
    keep = true != ignore
    ref = np.bincount(true[keep] * k + pred[keep], minlength=k * k).reshape(k, k)
    assert matrix.tolist() == ref.tolist()
    inter, union = np.diag(ref), ref.sum(0) + ref.sum(1) - np.diag(ref)
    iou = inter / union * 100
    assert s["iou"] == pytest.approx(iou.tolist())
    assert s["miou"] == pytest.approx(float(np.nanmean(iou)))
    assert s["pixel_acc"] == pytest.approx(inter.sum() / keep.sum() * 100)


def _scores_with(k, ignore, images):
    matrix = ConfusionMatrix(k, ignore)
    for pred, target in images:
        matrix.update(torch.from_numpy(pred), torch.from_numpy(target))
    return matrix.compute(), scores_from_confusion(matrix.compute())
