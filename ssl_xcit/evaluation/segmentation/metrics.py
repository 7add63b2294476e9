"""mIoU, per-class IoU and pixel accuracy from one confusion matrix over every scored pixel of a split.

This is how mmsegmentation (and so DINOv2's linear probe) scores: the matrix sums intersections and unions over
the whole split before dividing, so a large image weighs more than a small one, and an image is never averaged
on its own. A class absent from both the ground truth and the predictions of the split has a 0/0 IoU: NaN, as in
mmsegmentation, left out of the mean (a class predicted but never present scores 0 and stays in it).
"""

from __future__ import annotations

import math

import torch
from torchmetrics.classification import MulticlassConfusionMatrix

__all__ = ["ConfusionMatrix", "scores_from_confusion"]


class ConfusionMatrix:
    """Running (num_classes x num_classes) confusion matrix, rows ground truth, columns prediction; pixels whose
    target is ``ignore_index`` are not counted.

    torchmetrics' matrix does the counting (a bincount of target * K + prediction); the checks of every update
    are left to the caller, which validates each mask once when it is read."""

    def __init__(self, num_classes: int, ignore_index: int | None) -> None:
        self.num_classes = num_classes
        self._metric = MulticlassConfusionMatrix(num_classes, ignore_index=ignore_index, validate_args=False)

    def update(self, prediction: torch.Tensor, target: torch.Tensor) -> None:
        """Count one image (or batch) of predicted and true class ids of the same shape."""
        if prediction.shape != target.shape:
            raise ValueError(f"prediction {tuple(prediction.shape)} and target {tuple(target.shape)} differ")
        self._metric.update(prediction.reshape(-1).long().cpu(), target.reshape(-1).long().cpu())

    def compute(self) -> torch.Tensor:
        """The matrix so far, int64."""
        return self._metric.compute().long()


def scores_from_confusion(matrix: torch.Tensor) -> dict[str, float | list[float]]:
    """``miou``, ``pixel_acc`` and ``iou`` (per class), in percent, from a confusion matrix (rows truth).

    IoU_k = TP / (TP + FP + FN); NaN when the class is in neither truth nor prediction, and mIoU is the mean of
    the other classes. Pixel accuracy is correct pixels over scored pixels (mmsegmentation's aAcc).
    """
    matrix = matrix.double()
    tp = matrix.diag()
    union = matrix.sum(0) + matrix.sum(1) - tp
    iou = torch.where(union > 0, tp / union.clamp(min=1), torch.full_like(tp, math.nan)) * 100
    total = matrix.sum()
    present = ~iou.isnan()
    return {
        "miou": float(iou[present].mean()) if bool(present.any()) else math.nan,
        "pixel_acc": float(tp.sum() / total * 100) if total > 0 else math.nan,
        "iou": [float(v) for v in iou],
    }
