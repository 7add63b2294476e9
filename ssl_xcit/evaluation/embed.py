"""In-process feature extraction: the loop used inside a running fit (online k-NN) and by scripts.

``extract_features`` (``ssl_xcit.evaluation.features``) drives the same per-batch computation,
:func:`~ssl_xcit.evaluation.features.compute_features`, through ``Trainer.predict`` so that it can shard over
GPUs. A Trainer cannot be started inside another Trainer's ``fit``, so callbacks use :func:`embed_dataset`: one
process, one device, the same features.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ssl_xcit.data.datasets import collate_skip_none
from ssl_xcit.errors import UserError
from ssl_xcit.evaluation.features import FeatureConfig, compute_features
from ssl_xcit.utils.compile import dynamic_batch

__all__ = ["embed_dataset"]


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
) -> dict[str, torch.Tensor]:
    """``{"features" (N, D) float32 on CPU, "labels" (N,)}`` of the readable images of ``dataset``, in order.

    A module runs in eval mode and gets back the mode of every submodule afterwards (a DINO teacher mid-fit
    stays in train mode). Batches whose images were all unreadable are skipped, as in ``extract_features``.
    With ``allow_empty`` (one shard of a dataset split over processes) no readable image gives (0, 0)
    features and no labels instead of an error.
    """
    config = config or FeatureConfig()
    if allow_empty and len(dataset) == 0:  # type: ignore[arg-type]
        return {"features": torch.empty(0, 0), "labels": torch.empty(0, dtype=torch.long)}
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise UserError("embed_dataset needs a dataset with at least one image")
    loader = DataLoader(
        dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers, collate_fn=collate_skip_none
    )
    modes = {name: m.training for name, m in model.named_modules()} if isinstance(model, nn.Module) else {}
    if isinstance(model, nn.Module):
        model.eval()
    feats, labels = [], []
    try:
        for batch in loader:
            if batch is None:  # every image of the batch was unreadable
                continue
            images = batch[0] if device is None else batch[0].to(device)
            images = dynamic_batch(images)  # the short last batch reuses a compiled model's graph
            feats.append(compute_features(model, images, config).float().cpu())
            labels.append(torch.as_tensor(batch[1]).long())
    finally:
        if isinstance(model, nn.Module):
            for name, m in model.named_modules():
                m.training = modes.get(name, m.training)
    if not feats and allow_empty:
        return {"features": torch.empty(0, 0), "labels": torch.empty(0, dtype=torch.long)}
    if not feats:
        raise UserError(f"no readable image among the {len(dataset)} of the dataset")  # type: ignore[arg-type]
    return {"features": torch.cat(feats), "labels": torch.cat(labels)}
