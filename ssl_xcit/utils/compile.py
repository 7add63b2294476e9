"""``torch.compile`` with static shapes except the batch: one graph per crop size, whatever the batch size."""

from __future__ import annotations

import sys

import torch


def dynamic_batch(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its first dimension marked dynamic for ``torch.compile``, so a batch of another size (images
    dropped as unreadable, an epoch's short last batch) reuses the compiled graph. Without it, a backbone
    compiled with ``dynamic=False`` recompiles for every new size: one rank recompiling stalls the others, and
    after ``cache_size_limit`` (8) recompiles dynamo falls back to eager, silently. ``maybe_``: a batch of 1
    may still get a graph of its own. Does nothing while nothing was compiled (dynamo not imported)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and x.dim() > 0:
        dynamo.maybe_mark_dynamic(x, 0)
    return x
