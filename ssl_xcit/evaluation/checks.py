"""Checks on evaluation datasets, run before any feature is extracted, each ending in a one-line ``UserError``."""

from __future__ import annotations

import os

from torch.utils.data import Dataset

from ssl_xcit.errors import UserError

__all__ = ["check_not_empty", "check_same_classes"]


def check_not_empty(dataset: Dataset, name: str, root: str | os.PathLike | None = None) -> None:
    """Raise a clear error for a split without images."""
    if len(dataset) == 0:  # type: ignore[arg-type]
        where = f" ({root})" if root is not None else ""
        raise UserError(f"the {name} split{where} has no images; it needs at least one readable image")


def check_same_classes(train_classes: list[str] | None, val_classes: list[str] | None) -> None:
    """Train and val must have the same class folders, else label i would mean different classes in each."""
    if train_classes is None or val_classes is None:
        missing = "train" if train_classes is None else "val"
        raise UserError(
            f"the {missing} split has no class labels; k-NN and linear evaluation need ImageFolder trees "
            "(one subfolder per class) for both train and val"
        )
    if list(train_classes) == list(val_classes):
        return
    only_train = sorted(set(train_classes) - set(val_classes))
    only_val = sorted(set(val_classes) - set(train_classes))
    raise UserError(
        "train and val class sets differ: "
        f"only in train: {only_train or 'none'}; only in val: {only_val or 'none'} "
        f"({len(train_classes)} train vs {len(val_classes)} val classes). Both splits need the same class "
        "subfolders so that label indices mean the same class."
    )
