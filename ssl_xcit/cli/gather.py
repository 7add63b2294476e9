"""``ssl-xcit gather-checkpoint SRC OUT``: a sharded checkpoint (the folder ``--trainer.strategy fsdp2`` writes)
as one file, the form ``--trainer.strategy fsdp2_whole`` writes; another trainer's DCP folder (DINOv3's) as its
whole state dict (``ssl_xcit.models.sharded``); OUT ``*.safetensors`` holds the model's tensors only. The file
is written as the folder is read, a bounded group of
tensors at a time, so a folder larger than memory can be gathered."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> Path:
    """Parse ``argv``, write OUT; returns its path."""
    from ssl_xcit.models.sharded import gather_checkpoint

    parser = argparse.ArgumentParser(
        prog="ssl-xcit gather-checkpoint",
        description="Write a sharded (FSDP2) checkpoint folder as one checkpoint file.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "source",
        help="the checkpoint folder: .metadata and __<rank>_0.distcp, with meta.pt when fsdp2 wrote it",
    )
    parser.add_argument(
        "out",
        help="the file to write: e.g. last_whole.ckpt (everything: resumable), or a .safetensors of the model's "
        "tensors only (no optimiser state: for other tools, and half the size)",
    )
    args = parser.parse_args(None if argv is None else list(argv))
    out = gather_checkpoint(args.source, args.out)
    print(f"wrote {out}")
    return out
