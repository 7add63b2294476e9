"""The frozen backbone that evaluation extracts features with."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from ssl_xcit.errors import UserError
from ssl_xcit.models.sharded import is_checkpoint

__all__ = ["build_eval_backbone"]


def build_eval_backbone(weights: str | os.PathLike | None, arch: str | None, seed: int = 0) -> nn.Module:
    """The frozen backbone for evaluation: ``build_backbone`` (any checkpoint layout), eval mode, no grads.

    Without ``weights`` the backbone is randomly initialised from ``seed`` (a baseline); ``arch`` is then
    required.
    """
    from ssl_xcit.models import build_backbone

    if weights is None:
        if arch is None:
            raise UserError("give --weights, or --arch NAME to evaluate a randomly initialised backbone")
        torch.manual_seed(seed)
    elif not is_checkpoint(weights):
        raise FileNotFoundError(f"weights file not found: {weights}")
    model = build_backbone(None if weights is None else str(weights), arch)
    model.requires_grad_(False)
    return model.eval()
