"""Mid-epoch resume on an image folder: ``python resume_worker.py OUT_DIR WORLD_SIZE KEY=VALUE ...``.

Three fits of the real ``DINODataModule`` (an unlabelled folder of ``IMAGES`` PNGs) and a tiny DINO, with
``ModelCheckpoint(every_n_train_steps=every)`` writing ``last.ckpt``:

1. ``full``: the uninterrupted run;
2. ``crashed``: the same run, killed (an exception) right after optimiser step ``crash``;
3. ``resumed``: ``fit(ckpt_path=last.ckpt)`` of the crashed run, to the end.

Every run records, per optimiser step, the epoch and the dataset indices of its batch. Under ``torchrun
--nproc_per_node 2`` it is a real 2-process run (gloo); each rank saves ``OUT_DIR/rank<R>.pt``.

Options (``KEY=VALUE``): ``workers`` (0), ``augment`` (``cpu``), ``every`` (3), ``crash`` (7), ``epochs`` (1),
``batch`` (4 per process), ``accumulate`` (1), ``old`` (1: the checkpoint loses its loader position, as one
written before the resumable loader; one process only), ``images`` (64), ``shards`` (1: train on the images
prepared as LitData shards, 8 records a chunk; the indices are then record indices), ``s3`` (an ``s3://`` URL:
with ``shards=1``, the shards are uploaded there and read from it, the endpoint and keys from the environment),
``strategy`` (``ddp``; ``fsdp2`` or ``fsdp2_whole`` for FSDP2 with sharded or one-file checkpoints), ``gather``
(1: resume from the sharded checkpoint gathered into one file), ``gram`` (a step: Gram anchoring from that
optimiser step, its teacher refreshed every ``gram_every`` steps; the Gram teacher is then recorded too).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from PIL import Image

IMAGES = 64
OPTIONS = {
    "workers": 0,
    "augment": "cpu",
    "every": 3,
    "crash": 7,
    "epochs": 1,
    "batch": 4,
    "accumulate": 1,
    "old": "0",
    "images": IMAGES,
    "shards": "0",
    "s3": "",
    "strategy": "ddp",
    "gather": "0",
    "gram": "",
    "gram_every": 0,
}


def make_images(folder: Path, n: int = IMAGES) -> Path:
    """``n`` distinct 20 px PNGs (deterministic), written once."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        path = folder / f"img_{i:03d}.png"
        pixels = rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)
        if not path.exists():
            Image.fromarray(pixels).save(path)
    return folder


class Crash(Exception):
    """Stands for a kill: nothing after it is saved."""


class Record(L.Callback):
    """``(global step after the batch, epoch, indices)`` of every training batch; raises ``Crash`` after
    optimiser step ``crash_at``. ``saved`` is how many batches were recorded when the last checkpoint was
    written: the crashed run's batches up to there are the ones the resumed run must not repeat."""

    def __init__(self, crash_at: int | None = None) -> None:
        self.seen: list[tuple[int, int, list[int]]] = []
        self.rng: list[tuple[int, torch.Tensor]] = []  # (global step, CPU RNG state) at each batch's start
        self.crash_at = crash_at
        self.saved = 0

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.saved = len(self.seen)

    def setup(self, trainer, pl_module, stage):
        if trainer.world_size > 1:
            # After Lightning's DDP reseeds every rank alike: CPU streams that differ by rank, as each rank's
            # own GPU generator's does, so a resume handing rank 1 the states of rank 0 would show.
            torch.manual_seed(1 + trainer.global_rank)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rng.append((trainer.global_step, torch.get_rng_state()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append((trainer.global_step, trainer.current_epoch, batch[2].tolist()))
        if self.crash_at is not None and trainer.global_step >= self.crash_at:
            raise Crash(f"killed after step {trainer.global_step}")


def make_shards(images: Path, out: Path) -> Path:
    """The images as a prepared dataset (record ``i`` is ``sorted(images)[i]``), written once, meta last."""
    from litdata import optimize

    from ssl_xcit.data.shards import FORMAT_VERSION, META_FILE

    if not (out / META_FILE).exists():
        paths = sorted(str(p) for p in images.glob("*.png"))
        optimize(
            fn=_record, inputs=paths, output_dir=str(out), chunk_size=8, num_workers=1, verbose=False,
            keep_data_ordered=True, reorder_files=False, start_method="fork",
        )  # fmt: skip
        (out / META_FILE).write_text(f'{{"format": {FORMAT_VERSION}, "classes": null}}')
    return out


def _upload(folder: Path, url: str) -> None:
    """Every file of ``folder`` to the ``s3://`` prefix ``url`` (the metadata last, as prepare does)."""
    from ssl_xcit.data.shards import META_FILE
    from ssl_xcit.data.storage import provider

    s3 = provider(url)
    for path in sorted(folder.iterdir(), key=lambda p: p.name == META_FILE):
        s3.upload_file(str(path), f"{url}/{path.name}")


def _record(path: str) -> dict:
    return {"image": Path(path).read_bytes(), "label": -1, "path": Path(path).name}


def _datamodule(root: Path, opts: dict):
    from ssl_xcit.data import DINODataModule

    workers = int(opts["workers"])
    return DINODataModule(
        root=str(root),
        labelled=False,
        batch_size=int(opts["batch"]),
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=False,
        global_crops_size=16,
        local_crops_number=2,
        local_crops_size=8,
        eval_resize=16,
        eval_crop=16,
        augment_on=opts["augment"],
    )


def _model(opts: dict):
    from ssl_xcit.dino.module import DINO

    return DINO(
        backbone="xcit_nano_12_p8",
        backbone_kwargs={"depth": 1},
        drop_path_rate=0.1,  # draws from the global RNG: restored from the checkpoint
        out_dim=32,
        head_hidden_dim=32,
        head_bottleneck_dim=16,
        warmup_epochs=0,
        lr=0.01,
        freeze_last_layer=0,
        accumulate_grad_batches=int(opts["accumulate"]),
        collapse_guard="off",
        **_gram(opts),
    )


def _gram(opts: dict) -> dict:
    if opts["gram"] == "":
        return {}
    return {"gram_loss_weight": 1.0, "gram_start_step": int(opts["gram"]),
            "gram_refresh_every": int(opts["gram_every"])}  # fmt: skip


def _fit(out: Path, name: str, world_size: int, opts: dict, crash_at=None, ckpt_path=None) -> dict:
    from ssl_xcit.parallel.fsdp import whole_state_dict

    L.seed_everything(0, verbose=False)
    record = Record(crash_at)
    # As the recipes: last.ckpt every `every` optimiser steps and at every epoch end.
    common = dict(dirpath=out / "ckpt", filename="last", enable_version_counter=False)
    steps = ModelCheckpoint(every_n_train_steps=int(opts["every"]), **common)
    epochs = ModelCheckpoint(every_n_epochs=1, save_on_train_epoch_end=True, **common)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=opts["strategy"] if world_size > 1 else "auto",
        max_epochs=int(opts["epochs"]),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[record, steps, epochs],
        default_root_dir=out / name,
    )
    model = _model(opts)
    try:
        data = opts["s3"] or out / ("shards" if opts["shards"] == "1" else "images")
        trainer.fit(model, datamodule=_datamodule(data, opts), ckpt_path=ckpt_path)
    except Crash:
        pass
    return {
        "seen": record.seen,
        "rng": record.rng,
        "saved": record.saved,
        "global_step": trainer.global_step,
        "student": whole_state_dict(model.student),
        "teacher": whole_state_dict(model.teacher),
        "gram": whole_state_dict(model.gram_teacher) if model.gram_teacher is not None else {},
    }


def run(out_dir: str | Path, world_size: int, opts: dict) -> dict:
    torch.set_num_threads(1)
    out = Path(out_dir)
    opts = {**OPTIONS, **opts}
    rank = int(os.environ.get("RANK", 0))
    images = int(opts["images"])
    ready = out / "ready"
    if rank == 0:
        make_images(out / "images", images)
        if opts["shards"] == "1":
            make_shards(out / "images", out / "shards")
            if opts["s3"]:
                _upload(out / "shards", opts["s3"])
        ready.touch()
    while not ready.exists():  # the other rank waits for the data (the process group does not exist yet)
        time.sleep(0.05)
    full = _fit(out, "full", world_size, opts)
    crashed = _fit(out, "crashed", world_size, opts, crash_at=int(opts["crash"]))
    last = out / "ckpt" / "last.ckpt"  # a folder of shards under fsdp2, its other state in meta.pt
    checkpoint = torch.load(
        last / "meta.pt" if last.is_dir() else last, weights_only=False, map_location="cpu"
    )
    loader_state = checkpoint["loops"]["fit_loop"]["state_dict"].get("combined_loader")
    if opts["old"] == "1":  # as a checkpoint from before the resumable loader: no loader position
        del checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
        if rank == 0:
            torch.save(checkpoint, out / "ckpt" / "last.ckpt")
    resume_from = out / "ckpt" / "last.ckpt"
    if (
        opts["gather"] == "1"
    ):  # resume from the sharded folder gathered into one file (ssl-xcit gather-checkpoint)
        resume_from = out / "gathered.ckpt"
        if rank == 0:
            from ssl_xcit.models.sharded import gather_checkpoint

            gather_checkpoint(last, resume_from)
            (out / "gathered").touch()
        while not (out / "gathered").exists():
            time.sleep(0.05)
    resumed = _fit(out, "resumed", world_size, opts, ckpt_path=resume_from)
    result = {
        "full": full,
        "crashed": crashed,
        "resumed": resumed,
        "checkpoint_step": int(checkpoint["global_step"]),
        "loader_state": loader_state,
    }
    torch.save(result, out / f"rank{rank}.pt")
    return result


if __name__ == "__main__":
    options = dict(arg.split("=", 1) for arg in sys.argv[3:])
    run(sys.argv[1], int(sys.argv[2]), options)
