"""Ranks that must decide together: ``python agreement_worker.py OUT_DIR WORLD_SIZE SCENARIO[,SCENARIO...]``.

Run under ``torchrun --nproc_per_node 2`` (gloo, CPU). Each scenario makes the ranks differ in one way that
used to leave one rank waiting in a collective the other never entered, and saves what each rank saw to
``OUT_DIR/<scenario>_rank<R>_of<W>.pt``. With WORLD_SIZE 1 it is the single-process reference.

- ``collapse``: only rank 1's teacher signals show a collapse (guard action ``stop``).
- ``validation``: rank 1's first validation batch is all unreadable (Sinkhorn-Knopp centring all-reduces).
- ``koleo``: rank 1's first training batch keeps one readable image (KoLeo needs two).
- ``knn``: the online k-NN monitor, before and after one epoch.
- ``loss_scale``: under 16-mixed, only rank 1's GradScaler scale falls below 1 (the run must stop on both).
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from ddp_worker import GLOBAL_BATCH, FixedCrops, build
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

HEALTHY = (0.05, 0.2)  # confident per sample, spread over the batch


def _trainer(world_size: int, callbacks=(), **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=world_size,
        num_nodes=1,
        strategy="ddp" if world_size > 1 else "auto",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=list(callbacks),
        use_distributed_sampler=False,
        **kwargs,
    )


def _loader(dataset: Dataset, world_size: int, collate_fn=None) -> DataLoader:
    # Unshuffled: rank r gets samples r, r + 2, ... (its first batch of 4: r, r + 2, r + 4, r + 6).
    sampler = None
    if world_size > 1:
        sampler = DistributedSampler(
            dataset, world_size, int(os.environ["RANK"]), shuffle=False, drop_last=True
        )
    return DataLoader(
        dataset, batch_size=GLOBAL_BATCH // world_size, sampler=sampler, drop_last=True, collate_fn=collate_fn
    )


class FakeCollapseOnRank1(L.Callback):
    """Rank 1's teacher looks uniform at every step, rank 0's healthy (set before the guard reads them)."""

    def on_train_batch_end(self, trainer, pl_module, *args):
        out_dim = pl_module.hparams.out_dim
        pl_module.last_collapse_signals = (math.log(out_dim), 0.0) if trainer.global_rank == 1 else HEALTHY


def collapse(world_size: int) -> dict:
    from ssl_xcit.dino.collapse import CollapseGuard

    model = build(collapse_guard="stop", collapse_patience=2, collapse_grace_steps=0)
    trainer = _trainer(world_size, [FakeCollapseOnRank1()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _loader(FixedCrops(), world_size))
    guard = next(cb for cb in trainer.callbacks if isinstance(cb, CollapseGuard))
    return {
        "global_step": trainer.global_step,
        "events": guard.events,
        "warnings": [str(w.message) for w in caught if "collapse" in str(w.message)],
    }


def validation(world_size: int) -> dict:
    from ssl_xcit.data.datasets import collate_skip_none

    model = build(centering="sinkhorn_knopp")
    if world_size > 1:  # rank 1's first batch (1, 3, 5, 7) is unreadable; the second batch is 8..15
        dataset = FixedCrops(frozenset({1, 3, 5, 7}))
    else:  # the reference: only the batch both ranks can evaluate
        dataset = Subset(FixedCrops(), range(GLOBAL_BATCH, 2 * GLOBAL_BATCH))
    trainer = _trainer(world_size)
    trainer.validate(model, _loader(dataset, world_size, collate_skip_none), verbose=False)
    return {"val_loss": float(trainer.callback_metrics["val/loss"])}


class RecordKoLeo(L.Callback):
    def __init__(self) -> None:
        self.koleo: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.koleo.append(float(trainer.callback_metrics["train/koleo"]))


def koleo(world_size: int) -> dict:
    from ssl_xcit.data.datasets import collate_train

    model = build(koleo_weight=0.1)
    record = RecordKoLeo()
    trainer = _trainer(world_size, [record])
    # Rank 1's first batch (1, 3, 5, 7) keeps only image 1.
    trainer.fit(model, _loader(FixedCrops(frozenset({3, 5, 7})), world_size, collate_train))
    return {
        "global_step": trainer.global_step,
        "koleo": record.koleo,
        "student": {k: v.detach().clone() for k, v in model.student.state_dict().items()},
    }


class Labelled(Dataset):
    """Single-view 16 px images in 3 classes; ``unreadable`` indices return None (a file that failed)."""

    labelled = True

    def __init__(self, n: int, seed: int, unreadable: frozenset[int] = frozenset()) -> None:
        self.n, self.seed, self.unreadable = n, seed, unreadable

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i in self.unreadable:
            return None
        g = torch.Generator().manual_seed(self.seed * 1000 + i)
        return torch.randn(3, 16, 16, generator=g) + (i % 3), i % 3


class KNNData(L.LightningDataModule):
    # Odd sizes and unreadable images: the ranks' shares differ in length.
    bank = Labelled(21, 1, frozenset({4, 15}))
    queries = Labelled(11, 2, frozenset({10}))

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.world_size = world_size

    def train_dataloader(self) -> DataLoader:
        return _loader(FixedCrops(), self.world_size)

    def knn_datasets(self):
        return self.bank, self.queries


def knn(world_size: int) -> dict:
    from ssl_xcit.trainer import callbacks

    model = build()
    embedded = []  # images per eval-mode teacher forward on this rank (the k-NN feature passes)
    model.teacher.backbone.register_forward_hook(
        lambda m, i, o: embedded.append(i[0].shape[0]) if not m.training else None
    )
    bank_seen = []  # the k-NN bank each evaluation scored on this rank
    knn_scores = callbacks.weighted_knn

    def recording_knn(train_features, train_labels, *args, **kwargs):
        bank_seen.append((train_features.clone(), train_labels.clone()))
        return knn_scores(train_features, train_labels, *args, **kwargs)

    callbacks.weighted_knn = recording_knn
    callback = callbacks.OnlineKNN(k=5, batch_size=4, evaluate_at_start=True)
    trainer = _trainer(world_size, [callback])
    trainer.fit(model, datamodule=KNNData(world_size))
    callbacks.weighted_knn = knn_scores
    return {
        "history": callback.history,
        "banks": bank_seen,
        "images_embedded": sum(embedded),
        "logged_top1": float(trainer.callback_metrics.get("knn/top1", float("nan"))),
    }


class LowScaleOnRank1(L.Callback):
    """Rank 1's GradScaler scale drops to 0.25 after the first step; rank 0's stays at 65536."""

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_rank == 1:
            trainer.precision_plugin.scaler._scale.fill_(0.25)


def loss_scale(world_size: int) -> dict:
    from lightning.pytorch.plugins import MixedPrecision

    from ssl_xcit.errors import TrainingDiverged

    model = build(sync_every_n_steps=1)
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    trainer = _trainer(world_size, [LowScaleOnRank1()], plugins=[plugin])
    try:
        trainer.fit(model, _loader(FixedCrops(), world_size))
        error = None
    except TrainingDiverged as err:
        error = str(err)
    return {"global_step": trainer.global_step, "error": error}


SCENARIOS = {
    "collapse": collapse,
    "validation": validation,
    "koleo": koleo,
    "knn": knn,
    "loss_scale": loss_scale,
}


def run(out_dir: str | Path, world_size: int, scenario: str) -> dict:
    torch.set_num_threads(1)
    result = SCENARIOS[scenario](world_size)
    rank = int(os.environ.get("RANK", 0))
    torch.save(result, Path(out_dir) / f"{scenario}_rank{rank}_of{world_size}.pt")
    return result


if __name__ == "__main__":
    # SCENARIO may list several, comma-separated: they run one after another in the same 2 processes, since
    # starting torchrun and importing torch and Lightning in both ranks costs more than a scenario.
    for scenario in sys.argv[3].split(","):
        run(sys.argv[1], int(sys.argv[2]), scenario)
