"""Activation checkpointing per block for every family (``--model.activation_checkpointing true``).

Each transformer block keeps only its input during the forward and recomputes its activations in the
backward (``torch.utils.checkpoint``, non-reentrant, RNG state preserved so drop path draws the same masks).
The block's ``forward`` is wrapped on the instance, so parameter names, state dicts and checkpoints are
unchanged, and FSDP2's per-block units (``ssl_xcit.parallel.fsdp``) and DDP wrap it as they wrap the block.

BatchNorm layers inside a block (XCiT's LPI) run twice per step; the recomputation normalises with the
batch statistics as the first pass did, and the running statistics it moves are put back afterwards, so they
match a run without checkpointing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

# The containers that hold a family's blocks: XCiT (``blocks``, ``cls_attn_blocks``), CaiT (``blocks``, timm's
# ``blocks_token_only``), ViT (timm's ``blocks``, a Sequential), BiXT (``blocks``), CrossFormer++
# (``layers[i].blocks``, one per stage).
BLOCK_LISTS = ("blocks", "cls_attn_blocks", "blocks_token_only")


def blocks(backbone: nn.Module) -> list[nn.Module]:
    """The backbone's transformer blocks, in order: every item of a ``ModuleList`` or ``Sequential`` named in
    ``BLOCK_LISTS``, at any depth."""
    found = []
    for name, module in backbone.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and name.rsplit(".", 1)[-1] in BLOCK_LISTS:
            found.extend(module)
    return found


@contextlib.contextmanager
def _statistics_kept(block: nn.Module) -> Iterator[None]:
    """The BatchNorm running statistics of ``block`` as they were before (the recomputation must run the same
    ops as the forward did, so it updates them and they are put back)."""
    kept = [
        (buffer, buffer.clone())
        for m in block.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        for buffer in (m.running_mean, m.running_var, m.num_batches_tracked)
        if buffer is not None
    ]
    try:
        yield
    finally:
        for buffer, value in kept:
            buffer.copy_(value)


def _checkpointed(block: nn.Module, forward: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        def contexts() -> tuple[Any, Any]:
            return contextlib.nullcontext(), _statistics_kept(block)

        return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    return run


def enable_activation_checkpointing(backbone: nn.Module) -> int:
    """Checkpoint every block of ``backbone`` (idempotent); returns the number of blocks. A backbone without
    a block list is refused (a UserError naming it)."""
    from ssl_xcit.errors import UserError

    found = blocks(backbone)
    if not found:
        raise UserError(
            f"activation checkpointing found no blocks in {type(backbone).__name__} (looked for {BLOCK_LISTS})"
        )
    for block in found:
        if not getattr(block, "_activation_checkpointed", False):
            block.forward = _checkpointed(block, block.forward)
            block._activation_checkpointed = True
    return len(found)
