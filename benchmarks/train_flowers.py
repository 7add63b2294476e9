"""Proof that DINO learns on real photos: pretrain a small XCiT on flowers5 for a bounded CPU time, then compare
k-NN top-1 on a held-out split against the same backbone at random initialisation and against raw pixels.

    python benchmarks/train_flowers.py --minutes 15
    python benchmarks/train_flowers.py --data ../shared/data/flowers5 --minutes 15 --out runs/flowers5

The split is fixed and deterministic (``ssl_xcit.data.splits.stratified_split``, 20 % of every class held out,
seed 0); DINO never sees the held-out images, and the k-NN bank is the training split (labels used only by
k-NN). The number of epochs is chosen from a timing probe so that the cosine schedules end inside the budget.
Prints a table and writes ``OUT/results.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F

from ssl_xcit.data.datamodule import DINODataModule
from ssl_xcit.dino.callbacks import OnlineKNN
from ssl_xcit.dino.module import DINO
from ssl_xcit.evaluation.embed import embed_dataset
from ssl_xcit.evaluation.knn import weighted_knn

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data", default=str(REPO.parent / "shared" / "data" / "flowers5"), help="ImageFolder root"
    )
    p.add_argument("--minutes", type=float, default=15.0, help="training budget (wall clock)")
    p.add_argument("--out", default=str(REPO / "runs" / "flowers5"))
    p.add_argument("--backbone", default="xcit_nano_12_p16")
    p.add_argument("--depth", type=int, default=4, help="XCA blocks (fewer = more steps in the budget)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--global-size", type=int, default=64)
    p.add_argument("--local-size", type=int, default=32)
    p.add_argument("--local-crops", type=int, default=4)
    p.add_argument("--eval-size", type=int, default=64)
    p.add_argument("--val-fraction", type=float, default=0.2)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--workers", type=int, default=1)
    return p.parse_args()


def model_kwargs(args: argparse.Namespace) -> dict:
    # Small-data DINO (recipes/small_dataset.yaml): few prototypes, sharp teacher, fast EMA, higher lr.
    return dict(
        backbone=args.backbone,
        backbone_kwargs={"depth": args.depth},
        drop_path_rate=0.1,
        out_dim=1024,
        norm_last_layer=True,
        # BatchNorm in the head MLP: the batch cannot collapse to one point, which is what a tiny model on
        # few images otherwise does within ~50 steps (teacher entropy -> ln(out_dim), KL-to-uniform -> 0).
        use_bn_in_head=True,
        warmup_teacher_temp=0.02,
        teacher_temp=0.04,
        momentum_teacher=0.99,
        lr=0.004,
        min_lr=1e-5,
        weight_decay=0.04,
        weight_decay_end=0.1,
        clip_grad=3.0,
        freeze_last_layer=1,
    )


def features(fn, dataset, batch_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    out = embed_dataset(fn, dataset, batch_size=batch_size)  # the package's one in-process extraction loop
    return out["features"], out["labels"]


def knn_top1(bank, bank_y, query, query_y, k: int) -> float:
    scores = weighted_knn(bank, bank_y, query, ks=(k,), temperature=0.07)[k]
    return 100.0 * float((scores.argmax(1) == query_y).float().mean())


def evaluate(backbone: torch.nn.Module, bank_ds, query_ds, k: int) -> float:
    bank, bank_y = features(backbone, bank_ds)
    query, query_y = features(backbone, query_ds)
    return knn_top1(bank, bank_y, query, query_y, k)


def main() -> dict:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dm = DINODataModule(
        root=args.data,
        val_fraction=args.val_fraction,
        split_seed=0,
        batch_size=args.batch_size,
        num_workers=args.workers,
        global_crops_size=args.global_size,
        local_crops_number=args.local_crops,
        local_crops_size=args.local_size,
        local_crops_scale=(0.1, 0.4),
        eval_resize=args.eval_size,
        eval_crop=args.eval_size,
    )
    dm.setup("fit")
    bank_ds, query_ds = dm.knn_datasets()
    print(f"flowers5: {len(bank_ds)} train (DINO + k-NN bank) / {len(query_ds)} held-out queries")

    L.seed_everything(0, verbose=False)
    random_init = DINO(**model_kwargs(args)).teacher.backbone
    t0 = time.perf_counter()
    rand_top1 = evaluate(random_init, bank_ds, query_ds, args.k)
    pix_fn = lambda x: F.normalize(x.flatten(1), dim=1)  # noqa: E731 - raw pixels after the eval transform
    pixel_top1 = knn_top1(*features(pix_fn, bank_ds), *features(pix_fn, query_ds), args.k)
    eval_seconds = time.perf_counter() - t0
    print(f"random init {rand_top1:.2f}% | raw pixels {pixel_top1:.2f}% (k={args.k}, T=0.07)")

    # Timing probe: a few real training steps, to fit whole epochs (and the cosine schedules) in the budget.
    L.seed_everything(0, verbose=False)
    probe = DINO(**{**model_kwargs(args), "warmup_epochs": 0})
    probe_trainer = L.Trainer(
        max_epochs=1, limit_train_batches=4, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    t0 = time.perf_counter()
    probe_trainer.fit(probe, dm)
    step_seconds = (time.perf_counter() - t0) / 4
    steps_per_epoch = len(dm.train_dataset) // args.batch_size
    budget = args.minutes * 60 - 2 * eval_seconds
    epochs = max(1, math.floor(budget / (step_seconds * steps_per_epoch + eval_seconds)))
    print(
        f"probe: {step_seconds:.2f} s/step, {steps_per_epoch} steps/epoch -> {epochs} epochs in {args.minutes} min"
    )

    L.seed_everything(0, verbose=False)
    model = DINO(
        **{
            **model_kwargs(args),
            "warmup_epochs": max(1, epochs // 10),
            "warmup_teacher_temp_epochs": epochs // 2,
        }
    )
    knn = OnlineKNN(every_n_epochs=max(1, epochs // 4), k=args.k, evaluate_at_start=False)
    trainer = L.Trainer(
        max_epochs=epochs,
        max_time={"minutes": args.minutes * 1.5},  # safety net only
        accelerator="cpu",
        default_root_dir=out,
        logger=L.pytorch.loggers.CSVLogger(out, name="csv"),
        callbacks=[knn],
        enable_checkpointing=False,
        enable_progress_bar=False,
        log_every_n_steps=10,
    )
    t0 = time.perf_counter()
    trainer.fit(model, dm)
    train_minutes = (time.perf_counter() - t0) / 60
    dino_top1 = evaluate(model.teacher.backbone, bank_ds, query_ds, args.k)

    results = {
        "dino_top1": dino_top1,
        "random_init_top1": rand_top1,
        "raw_pixels_top1": pixel_top1,
        "epochs": epochs,
        "steps": trainer.global_step,
        "train_minutes": train_minutes,
        "knn_history": knn.history,
        "args": vars(args),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nflowers5 held-out k-NN top-1 (k={args.k}, T=0.07), {len(query_ds)} queries")
    print(
        f"  DINO {args.backbone} depth {args.depth}, {epochs} epochs / {train_minutes:.1f} min: {dino_top1:6.2f}%"
    )
    print(f"  same backbone, random init:                 {rand_top1:6.2f}%")
    print(f"  raw pixels ({args.eval_size}x{args.eval_size}):                      {pixel_top1:6.2f}%")
    return results


if __name__ == "__main__":
    main()
