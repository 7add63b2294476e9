"""The labelled sets of the online k-NN monitor: the val set in the training classes, and the (bank, queries)
pair with the eval transform."""

from __future__ import annotations

from collections.abc import Callable

from ssl_xcit.data.datasets import ImageDataset
from ssl_xcit.data.splits import stratified_split
from ssl_xcit.data.streaming import ShardTrainSet, dataset_view, knn_bank
from ssl_xcit.errors import UserError


def aligned_val(
    val_set: ImageDataset | None, classes: list[str] | None, val_root: str | None
) -> tuple[ImageDataset | None, str | None]:
    """``(val set relabelled with the training classes, None)``, or ``(None, why the k-NN monitor is off)``."""
    if classes is None:
        return None, (
            "the training data has no labels (the k-NN bank needs them): use an ImageFolder tree or a list "
            "file with a label column"
        )
    if val_set is None:
        return None, "no labelled val set: set data.val_root or data.val_fraction > 0"
    if val_set.classes is None:
        return None, f"val_root {val_root} has no labels (it is not an ImageFolder tree)"
    index = {name: i for i, name in enumerate(classes)}
    unknown = sorted(set(val_set.classes) - set(index))
    if unknown:
        raise UserError(
            f"val_root {val_root} has classes absent from the training data: {unknown[:10]}; "
            f"training classes: {classes[:10]}{'...' if len(classes) > 10 else ''}"
        )
    samples = [(p, index[val_set.classes[y]]) for p, y in val_set.samples]
    return dataset_view(val_set, None, samples, classes), None


def knn_sets(
    train: ImageDataset | ShardTrainSet,
    val: ImageDataset,
    transform: Callable,
    bank_limit: int | None,
    seed: int,
) -> tuple[ImageDataset, ImageDataset]:
    """``(bank, queries)`` with ``transform``: the labelled training images (at most ``bank_limit``, a
    deterministic stratified subsample by ``seed``) and the val set."""
    queries = dataset_view(val, transform)
    if isinstance(train, ShardTrainSet):
        return knn_bank(train, transform, bank_limit, seed), queries
    bank_samples = train.samples
    if bank_limit is not None and bank_limit < len(bank_samples):
        _, bank_samples = stratified_split(bank_samples, bank_limit / len(bank_samples), seed)
    return ImageDataset(bank_samples, train.classes, transform), queries
