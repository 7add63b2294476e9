"""``ssl-xcit fit -c recipes/quickstart.yaml`` at tiny size under the loop census (``loop_census.py``):
``python census_worker.py OUT_DIR IMAGES WORLD_SIZE STEPS [PRECISION]``.

The recipe's callbacks run as a user runs them (its progress bar, loggers, the online k-NN monitor at the epoch's
end, checkpoints), with ``augment_on=device`` (the default on accelerators), accumulation 2 and
``sync_every_n_steps`` = ``log_every_n_steps`` = ``SYNC`` micro-batches (2 optimiser steps). Under ``torchrun --nproc_per_node 2``
it is a 2-process gloo DDP run. Each rank writes ``OUT_DIR/rank<r>.json``: the census's iterations.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from loop_census import LoopCensus

REPO = Path(__file__).resolve().parents[2]
SYNC = 4  # micro-batches between periodic reads: sync_every_n_steps (optimiser steps) x ACCUMULATE
ACCUMULATE = 2


def precision_args(precision: str) -> list[str]:
    """The CLI arguments of a Trainer precision. On the CPU Lightning turns 16-mixed into bf16 without a
    GradScaler, so 16-mixed runs through a MixedPrecision plugin with torch's CPU GradScaler."""
    if precision != "16-mixed":
        return [f"--trainer.precision={precision}"]
    scaler = '{"class_path": "torch.amp.GradScaler", "init_args": {"device": "cpu"}}'
    plugin = (
        '{"class_path": "lightning.pytorch.plugins.MixedPrecision", "init_args": '
        f'{{"precision": "16-mixed", "device": "cpu", "scaler": {scaler}}}}}'
    )
    # A ViT: the XCiT of the recipe trains to a non-finite loss under float16 on the CPU (docs/training.md).
    vit = [
        "--model.init_args.backbone=vit_tiny_patch16_224",
        "--model.init_args.backbone_kwargs={depth: 1, patch_size: 8}",
    ]
    return ["--trainer.precision=null", f"--trainer.plugins={plugin}", *vit]


def fit_args(images: Path, out: Path, world_size: int, steps: int, precision: str = "32-true") -> list[str]:
    return [
        "fit", "-c", str(REPO / "recipes" / "quickstart.yaml"),
        "--model.init_args.backbone_kwargs={depth: 1}", "--model.init_args.out_dim=64",
        "--model.init_args.head_hidden_dim=32", "--model.init_args.head_bottleneck_dim=16",
        "--model.init_args.warmup_epochs=0", f"--model.init_args.accumulate_grad_batches={ACCUMULATE}",
        f"--model.init_args.sync_every_n_steps={SYNC // ACCUMULATE}",
        f"--data.init_args.root={images / 'train'}", f"--data.init_args.val_root={images / 'val'}",
        "--data.init_args.batch_size=4", "--data.init_args.num_workers=0",
        "--data.init_args.persistent_workers=false", "--data.init_args.local_crops_number=2",
        "--data.init_args.global_crops_size=16", "--data.init_args.local_crops_size=8",
        "--data.init_args.eval_resize=16", "--data.init_args.eval_crop=16", "--data.init_args.augment_on=device",
        "--trainer.accelerator=cpu", f"--trainer.devices={world_size}",
        f"--trainer.strategy={'ddp' if world_size > 1 else 'auto'}", "--trainer.max_epochs=1",
        f"--trainer.limit_train_batches={steps}", f"--trainer.log_every_n_steps={SYNC}",
        "--trainer.enable_model_summary=false", *precision_args(precision), "--run_dir", str(out / "run"),
    ]  # fmt: skip


def main(
    out: Path,
    images: Path,
    world_size: int,
    steps: int,
    precision: str = "32-true",
    extra: tuple[str, ...] = (),
) -> list[dict]:
    """The census of the fit; ``extra``: more command-line arguments (options under test)."""
    from ssl_xcit.cli import main as cli_main

    census = LoopCensus()
    with census.installed():
        cli_main([*fit_args(images, out, world_size, steps, precision), *extra])
    rank = int(os.environ.get("RANK", "0"))
    (out / f"rank{rank}.json").write_text(json.dumps(census.windows))
    return census.windows


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:6])
