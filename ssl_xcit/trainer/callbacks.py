"""Online k-NN evaluation of the teacher backbone during DINO pretraining.

The DINO loss says little about feature quality (the DINO authors: watch k-NN, not the loss), so every N
epochs the teacher backbone embeds a labelled train/val pair from the datamodule (``knn_datasets()``, with an
evaluation transform) and a weighted k-NN classifier (``ssl_xcit.evaluation.knn``, DINO's ``eval_knn.py``)
scores the val split. k and T are logged next to the accuracy, so a changed default never passes silently.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import Dataset

from ssl_xcit.errors import UserError
from ssl_xcit.evaluation.embed import embed_dataset
from ssl_xcit.evaluation.knn import weighted_knn


def _labels_of(dataset: Dataset) -> bool:
    labelled = getattr(dataset, "labelled", None)
    if labelled is not None:
        return bool(labelled)
    targets = getattr(dataset, "targets", None)
    return targets is not None and len(targets) > 0 and min(targets) >= 0


def _gather_rows(
    strategy: Any, features: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate every rank's ``features`` (n_r, D) and ``labels`` (n_r,) in rank order, on every rank.

    The ranks' row counts differ (unreadable images, a short last share) and a rank may hold none, so the
    counts and the width travel first and the rows are padded to the largest count for the all-gather.
    """
    device = strategy.root_device
    local = torch.tensor([features.shape[0], features.shape[-1] if features.shape[0] else 0], device=device)
    sizes = strategy.all_gather(local).reshape(-1, 2).cpu()
    rows, dim = int(sizes[:, 0].max()), int(sizes[:, 1].max())
    if rows == 0:
        raise UserError("online k-NN: no readable image in the dataset on any rank")
    padded = torch.zeros(rows, dim, dtype=torch.float32, device=device)
    padded_labels = torch.full((rows,), -1, dtype=torch.long, device=device)
    if features.shape[0]:
        padded[: features.shape[0]] = features.to(device, torch.float32)
        padded_labels[: features.shape[0]] = labels.to(device)
    all_features = strategy.all_gather(padded).cpu()
    all_labels = strategy.all_gather(padded_labels).cpu()
    counts = sizes[:, 0].tolist()
    return (
        torch.cat([all_features[r, :n] for r, n in enumerate(counts)]),
        torch.cat([all_labels[r, :n] for r, n in enumerate(counts)]),
    )


class OnlineKNN(Callback):
    """Weighted k-NN top-1 (%) of the teacher backbone on the datamodule's labelled val split.

    Args:
        every_n_epochs: evaluate after every N-th training epoch (and after the last one).
        k: neighbours (DINO's eval_knn default set is 10/20/100/200; 20 "usually works best").
        temperature: vote temperature T of ``exp(sim / T)`` (0.07 in DINO).
        batch_size: images per forward pass for feature extraction.
        num_workers: dataloader workers for feature extraction.
        evaluate_at_start: also evaluate before the first step of a fresh run, i.e. the random-init
            baseline the trained numbers should beat (logged at step 0).
        max_train_samples: cap the k-NN bank (evenly spaced subset) to bound the cost on large datasets.

    Logs ``knn/top1``, ``knn/k`` and ``knn/temperature``. The teacher backbone is put in eval mode for the
    feature pass (BN running statistics, no drop path) and its previous mode is restored afterwards. Under
    DDP and FSDP2 each rank embeds 1/world of the images, every rank in the same number of forwards (a short
    share is padded, the padding dropped: a sharded teacher all-gathers in each forward), and the features
    are all-gathered, so every rank computes the same k-NN and no rank waits for another.
    Disabled, with a message, when the datamodule provides no labelled pair.
    """

    def __init__(
        self,
        every_n_epochs: int = 1,
        k: int = 20,
        temperature: float = 0.07,
        batch_size: int = 128,
        num_workers: int = 0,
        evaluate_at_start: bool = True,
        max_train_samples: int | None = None,
    ) -> None:
        super().__init__()
        if every_n_epochs < 1:
            raise UserError(f"every_n_epochs must be >= 1, got {every_n_epochs}")
        self.every_n_epochs = every_n_epochs
        self.k = k
        self.temperature = temperature
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.evaluate_at_start = evaluate_at_start
        self.max_train_samples = max_train_samples
        self.history: list[dict[str, float]] = []  # {"epoch", "step", "top1"} per evaluation
        self._datasets: tuple[Dataset, Dataset] | None = None
        self._disabled_reason: str | None = None

    # ----------------------------------------------------------------------------------------------- data
    def _resolve(self, trainer: Trainer) -> tuple[Dataset, Dataset] | None:
        if self._datasets is not None or self._disabled_reason is not None:
            return self._datasets
        datamodule = trainer.datamodule
        getter = getattr(datamodule, "knn_datasets", None)
        pair = getter() if callable(getter) else None
        if pair is None:
            self._disabled_reason = (
                "the datamodule has no labelled train/val pair (unlabelled data, or no val split)"
                if callable(getter)
                else f"{type(datamodule).__name__} has no knn_datasets() method"
            )
        else:
            train, val = pair
            if not (_labels_of(train) and _labels_of(val)):
                self._disabled_reason = "the k-NN datasets carry no labels"
            else:
                self._datasets = (train, val)
        # A datamodule with `knn_unavailable_reason` already said so in its set-up line: one notice, not two.
        if self._disabled_reason and not getattr(datamodule, "knn_unavailable_reason", None):
            rank_zero_warn(f"Online k-NN disabled: {self._disabled_reason}. Training continues without it.")
        return self._datasets

    def _features(
        self,
        backbone: torch.nn.Module,
        dataset: Dataset,
        device: torch.device,
        trainer: Trainer | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, labels) of the readable images of ``dataset``, in order, on every rank. Split over
        ranks, each embeds one contiguous share in as many forwards as every other rank (a sharded teacher
        all-gathers in each), and the shares are all-gathered: the work is split, nobody waits for rank 0,
        and every rank gets the whole, identical set."""
        world, rank = getattr(trainer, "world_size", 1), getattr(trainer, "global_rank", 0)
        # The package's one in-process extraction: eval mode inside, every submodule's mode restored after.
        out = embed_dataset(
            backbone,
            dataset,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            device=device,
            allow_empty=world > 1,
            rank=rank,
            world_size=world,
        )
        if world == 1:
            return out["features"], out["labels"]
        return _gather_rows(trainer.strategy, out["features"], out["labels"])

    # --------------------------------------------------------------------------------------- evaluation
    def evaluate(self, trainer: Trainer, pl_module: LightningModule) -> float | None:
        """Top-1 (%) of the teacher backbone, or None when disabled. Under DDP every rank takes part and gets
        the same number (each embeds a share of the images; the k-NN runs on the gathered features)."""
        pair = self._resolve(trainer)
        if pair is None:
            return None
        train, val = pair
        if self.max_train_samples and len(train) > self.max_train_samples:
            step = len(train) / self.max_train_samples
            train = torch.utils.data.Subset(train, [int(i * step) for i in range(self.max_train_samples)])
        network = getattr(pl_module, "evaluated_network", "teacher")  # a distillation run judges its student
        backbone = getattr(pl_module, network).backbone
        train_f, train_y = self._features(backbone, train, pl_module.device, trainer)
        val_f, val_y = self._features(backbone, val, pl_module.device, trainer)
        scores = weighted_knn(train_f, train_y, val_f, ks=(self.k,), temperature=self.temperature)[self.k]
        top1 = 100.0 * float((scores.argmax(dim=1) == val_y).float().mean())
        # Under `validate` the trainer's counters are 0; the module knows the checkpoint's epoch and step.
        epoch = getattr(pl_module, "trained_epoch", trainer.current_epoch)
        step = getattr(pl_module, "trained_step", trainer.global_step)
        self.history.append({"epoch": epoch, "step": step, "top1": top1})
        rank_zero_info(
            f"online k-NN ({network}, k={self.k}, T={self.temperature:g}) epoch {epoch} "
            f"step {step}: top-1 {top1:.2f}% on {len(val_y)} val images"
        )
        return top1

    def _log(self, pl_module: LightningModule, top1: float | None) -> None:
        if top1 is None:
            return
        # Every rank holds the same value, so every rank logs it (a ModelCheckpoint monitoring knn/top1 then
        # decides the same everywhere); the mean over ranks of equal numbers is that number.
        kw = dict(on_step=False, on_epoch=True, sync_dist=True)
        pl_module.log("knn/top1", top1, prog_bar=True, **kw)
        pl_module.log("knn/k", float(self.k), **kw)
        pl_module.log("knn/temperature", float(self.temperature), **kw)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.evaluate_at_start and trainer.global_step == 0:
            top1 = self.evaluate(trainer, pl_module)
            if top1 is not None and trainer.is_global_zero:
                # Logged directly: Lightning's self.log is not allowed in on_train_start.
                for logger in trainer.loggers:
                    logger.log_metrics(
                        {"knn/top1": top1, "knn/k": float(self.k), "knn/temperature": self.temperature},
                        step=0,
                    )

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        epoch = trainer.current_epoch + 1
        last = trainer.max_epochs is not None and epoch >= trainer.max_epochs
        if epoch % self.every_n_epochs == 0 or last:
            self._log(pl_module, self.evaluate(trainer, pl_module))

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # `ssl-xcit validate` reports k-NN too; during fit the train-epoch hook above does it.
        if trainer.state.fn == "validate" and not trainer.sanity_checking:
            self._log(pl_module, self.evaluate(trainer, pl_module))

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
