"""In-process feature extraction: the loop used inside a running fit (online k-NN, RankMe) and by scripts.

``extract_features`` (``ssl_xcit.evaluation.features``) drives the same per-batch computation,
:func:`~ssl_xcit.evaluation.features.compute_features`, through ``Trainer.predict`` so that it can shard over
GPUs. A Trainer cannot be started inside another Trainer's ``fit``, so callbacks use :func:`embed_dataset`: one
process, one device, the same features.

Inside a distributed fit each rank embeds one contiguous share of the images (``rank``, ``world_size``), and
the network may be sharded (FSDP2): then every forward all-gathers parameters, and a rank that ran one forward
more than another would wait in a collective the other never enters (gloo: "Received data size doesn't match
expected size"; NCCL: a hang). :func:`lockstep_batches` gives every rank the same number of forwards.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from ssl_xcit.data.datasets import collate_skip_none
from ssl_xcit.errors import UserError
from ssl_xcit.evaluation.features import FeatureConfig, compute_features
from ssl_xcit.utils.compile import dynamic_batch

__all__ = ["EvalBatch", "embed_dataset", "lockstep_batches", "lockstep_plan"]


class EvalBatch(NamedTuple):
    """One forward's input. The first ``real`` rows of ``images`` (and every entry of ``labels``) are readable
    images of this rank's share, in dataset order; the rest is padding, to forward and then drop."""

    images: torch.Tensor
    labels: torch.Tensor
    real: int


def lockstep_plan(num_items: int, world_size: int, batch_size: int) -> tuple[int, int]:
    """``(share, batches)``: rank r embeds items ``[r * share, (r + 1) * share)`` (cut at ``num_items``; the
    last ranks' shares are shorter, or empty) in ``batches`` forwards, the count of the longest share, on
    every rank."""
    if world_size < 1 or batch_size < 1:
        raise UserError(f"world_size and batch_size must be >= 1, got {world_size} and {batch_size}")
    share = math.ceil(num_items / world_size)
    return share, math.ceil(share / batch_size)


def lockstep_batches(
    dataset: Dataset, *, batch_size: int, num_workers: int = 0, rank: int = 0, world_size: int = 1
) -> Iterator[EvalBatch]:
    """This rank's contiguous share of ``dataset`` in batches, as many batches on every rank.

    With ``world_size`` 1 these are the readable images in order, batches without one left out. Split over
    ranks, a rank whose share is shorter (the last ranks of 129 images on 2, or of ImageNet-val's 50,000 on 64
    at batch 128: 7 batches against 6), or whose batch held no readable image, still forwards: a padding
    batch of one readable image twice (``real`` 0), found in the dataset if the rank has seen none. Only when
    the whole dataset is unreadable is there nothing to forward, on any rank. Concatenating every rank's real
    rows in rank order gives every readable image once, in dataset order.
    """
    n = len(dataset)  # type: ignore[arg-type]
    share, batches = lockstep_plan(n, world_size, batch_size)
    own = Subset(dataset, range(min(rank * share, n), min((rank + 1) * share, n)))
    loader = DataLoader(
        own, batch_size=batch_size, shuffle=False, num_workers=num_workers, collate_fn=collate_skip_none
    )
    padding: torch.Tensor | None = None
    empty = torch.empty(0, dtype=torch.long)
    batch_iter = iter(loader)
    for _ in range(batches):
        batch = next(batch_iter, None)  # None: an unreadable batch, or this rank's share is used up
        if batch is not None:
            images = batch[0]
            labels = torch.as_tensor(batch[1]).long() if len(batch) > 1 else torch.full((len(images),), -1)
            padding = images[:1].repeat(2, *[1] * (images.dim() - 1))  # 2 rows: see _first_readable
            yield EvalBatch(images, labels, len(images))
        elif world_size > 1:
            padding = padding if padding is not None else _first_readable(dataset)
            if padding is not None:
                yield EvalBatch(padding, empty, 0)
    del batch_iter  # a worker pool shuts down here, not at garbage collection


def _first_readable(dataset: Dataset) -> torch.Tensor | None:
    """The first readable image of ``dataset`` twice, as a padding batch (of 2: a compiled model marks the
    batch dimension dynamic, but a batch of 1 may get a graph of its own); None if the dataset has no readable
    image (then no rank has)."""
    for i in range(len(dataset)):  # type: ignore[arg-type]
        batch = collate_skip_none([dataset[i]] * 2)
        if batch is not None:
            return batch[0]
    return None


@torch.no_grad()
def embed_dataset(
    model: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    dataset: Dataset,
    *,
    config: FeatureConfig | None = None,
    batch_size: int = 128,
    num_workers: int = 0,
    device: torch.device | str | None = None,
    allow_empty: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, torch.Tensor]:
    """``{"features" (N, D) float32 on CPU, "labels" (N,)}`` of the readable images of ``dataset``, in order.

    A module runs in eval mode and gets back the mode of every submodule afterwards (a DINO teacher mid-fit
    stays in train mode). Batches whose images were all unreadable are skipped, as in ``extract_features``.
    With ``allow_empty`` (one shard of a dataset split over processes) no readable image gives (0, 0)
    features and no labels instead of an error. With ``world_size`` > 1 only this ``rank``'s contiguous share
    is embedded, in as many forwards as on every other rank (:func:`lockstep_batches`; padding dropped), so a
    sharded (FSDP2) model's all-gathers match up; concatenated in rank order the ranks' rows are the whole.
    """
    config = config or FeatureConfig()
    if allow_empty and len(dataset) == 0:  # type: ignore[arg-type]
        return {"features": torch.empty(0, 0), "labels": torch.empty(0, dtype=torch.long)}
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise UserError("embed_dataset needs a dataset with at least one image")
    modes = {name: m.training for name, m in model.named_modules()} if isinstance(model, nn.Module) else {}
    if isinstance(model, nn.Module):
        model.eval()
    feats, labels = [], []
    try:
        for batch in lockstep_batches(
            dataset, batch_size=batch_size, num_workers=num_workers, rank=rank, world_size=world_size
        ):
            images = batch.images if device is None else batch.images.to(device)
            images = dynamic_batch(images)  # the short last batch reuses a compiled model's graph
            out = compute_features(model, images, config)
            if batch.real:
                feats.append(out[: batch.real].float().cpu())
                labels.append(batch.labels)
    finally:
        if isinstance(model, nn.Module):
            for name, m in model.named_modules():
                m.training = modes.get(name, m.training)
    if not feats and allow_empty:
        return {"features": torch.empty(0, 0), "labels": torch.empty(0, dtype=torch.long)}
    if not feats:
        raise UserError(f"no readable image among the {len(dataset)} of the dataset")  # type: ignore[arg-type]
    return {"features": torch.cat(feats), "labels": torch.cat(labels)}
