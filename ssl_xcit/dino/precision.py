"""DINO's numerics under Lightning's precisions: the math that stays in float32 under autocast, and the
"true" half precisions that DINO refuses.

Mixed precision (``bf16-mixed``, ``16-mixed``) keeps float32 weights and runs the networks' matrix products
in half precision; everything after the networks (KoLeo, softmaxes, Sinkhorn-Knopp, the centres) runs in
float32 with autocast off, as DINOv2 does, and KoLeo's neighbour search in float64.

``bf16-true`` and ``16-true`` are refused. Lightning's "true" precisions mean the module's weights live in that
dtype, and DINO cannot train there: the teacher's EMA adds (1 - m) x (student - teacher), with m rising to 1
over the run, and that update is below half a unit in the last place of a bfloat16 (8-bit significand) or
float16 (11-bit) weight, so it rounds away and the teacher stops moving (issue 35 measured 0.009 of the 32-true
distance on the quickstart at m = 0.9995). The student's AdamW steps at the end of the cosine learning rate round
away the same way. Float32 master copies would fix that, but they are what ``bf16-mixed`` already is (DINOv2
keeps float32 parameters and computes in bfloat16 through FSDP's mixed precision): a "true" run with float32
masters would not be what a Lightning user asked for, and would not save the memory "true" is chosen for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ssl_xcit.errors import UserError

REFUSED_PRECISIONS = {"bf16-true": "bfloat16", "16-true": "float16"}


def check_precision(precision: str | None) -> None:
    """A one-line UserError for a Trainer precision DINO cannot train in (``bf16-true``, ``16-true``)."""
    dtype = REFUSED_PRECISIONS.get(str(precision))
    if dtype is not None:
        mixed = "bf16-mixed" if dtype == "bfloat16" else "16-mixed"
        raise UserError(
            f"precision {precision!r} keeps DINO's teacher in {dtype}, where its EMA update rounds to zero; "
            f"use --trainer.precision {mixed} (float32 weights, {dtype} compute)"
        )


@contextlib.contextmanager
def float32_math(device: torch.device) -> Iterator[None]:
    """Autocast off for ``device``'s type: the products inside run in the dtype of their inputs (callers cast
    to float32). A device type without autocast (meta) needs nothing."""
    if torch.amp.is_autocast_available(device.type):
        with torch.autocast(device.type, enabled=False):
            yield
    else:
        yield
