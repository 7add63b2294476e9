"""Label-free health of a run: RankMe, the effective rank of the teacher's embeddings of held-out images.

Without labels the online k-NN cannot run, and the loss says nothing about feature quality. RankMe (Garrido
et al. 2023, "RankMe: Assessing the downstream performance of pretrained self-supervised representations by
their rank") needs no labels: for the (N, D) matrix of embeddings with singular values sigma_k,

    p_k = sigma_k / sum_j sigma_j + eps,    RankMe = exp(-sum_k p_k log p_k),

a smooth count of the directions the embeddings use, between 1 and min(N, D). A collapsed teacher (every image
on one prototype, or the uniform output) maps images to nearly one point: RankMe falls towards 1. Untrained
networks also map images close together (one direction dominates), so a learning run climbs above its step-0
value (docs/training.md, "Reading the curves"). The patch tokens get their own value: iBOT and Gram anchoring
train them, and they can collapse while the CLS embedding is healthy.

The singular values come from the D x D Gram matrix X^T X, accumulated over batches and summed over ranks:
each rank embeds a share of the images, one all-reduce of a D x D matrix (not of N x D rows) joins them, and
every rank computes the same value from the same sum. Every rank runs as many forwards as the others (a short
share is padded and the padding left out of the sum), since a sharded (FSDP2) teacher all-gathers in each.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.utils.data import Dataset, Subset

from ssl_xcit.errors import UserError
from ssl_xcit.evaluation.embed import lockstep_batches

EPS = 1e-7  # the paper's epsilon


def rankme_from_singular_values(sigma: Tensor, eps: float = EPS) -> float:
    """RankMe of the singular values ``sigma`` (any order; negatives from round-off count as 0)."""
    sigma = sigma.double().clamp(min=0)
    if float(sigma.sum()) == 0.0:
        return 1.0  # an all-zero matrix: one (degenerate) direction
    p = sigma / sigma.sum() + eps
    return float(torch.exp(-(p * p.log()).sum()))


def rankme_from_gram(gram: Tensor, rows: int, eps: float = EPS) -> float:
    """RankMe of an (N, D) matrix X given only G = X^T X (D x D) and N = ``rows``: sigma = sqrt(eig(G)),
    the largest min(N, D) of them (the singular values X has)."""
    eig = torch.linalg.eigvalsh(gram.double())  # ascending
    return rankme_from_singular_values(eig.clamp(min=0).sqrt().flip(0)[: min(rows, gram.shape[0])], eps)


def rankme(embeddings: Tensor, eps: float = EPS) -> float:
    """RankMe of an (N, D) embedding matrix."""
    return rankme_from_singular_values(torch.linalg.svdvals(embeddings.double()), eps)


@torch.no_grad()
def held_out_grams(
    backbone: nn.Module,
    dataset: Dataset,
    device: torch.device,
    batch_size: int = 64,
    num_workers: int = 0,
    patch_tokens: bool = True,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, tuple[Tensor, int]]:
    """``{"embedding": (X^T X, N)}`` of the backbone's embeddings of ``dataset`` (``"patch"`` too: its
    final-norm patch tokens, every token a row), in float64 on ``device``. Eval mode inside; each submodule's
    mode is restored after (a teacher mid-fit stays in train mode). With ``world_size`` > 1, of this
    ``rank``'s contiguous share only, in as many forwards as on every other rank (``lockstep_batches``: a
    sharded backbone all-gathers in each); the padding forwards add nothing."""
    modes = {name: m.training for name, m in backbone.named_modules()}
    backbone.eval()
    grams: dict[str, list[Any]] = {}
    try:
        batches = lockstep_batches(
            dataset, batch_size=batch_size, num_workers=num_workers, rank=rank, world_size=world_size
        )
        for batch in batches:
            images = batch.images.to(device)
            if patch_tokens and getattr(backbone, "supports_masking", False):
                # One pass; the final-norm patch tokens, which iBOT and Gram anchoring train.
                cls, patches = backbone.forward_cls_patches(images)
            else:
                cls = backbone(images)
                patches = backbone.forward_patch_tokens(images)[0] if patch_tokens else None
            if not batch.real:  # padding: forwarded with the other ranks, counted nowhere
                continue
            outputs = {"embedding": cls[: batch.real]}
            if patches is not None:
                outputs["patch"] = patches[: batch.real].reshape(-1, patches.shape[-1])
            for key, rows in outputs.items():
                rows = rows.double()
                entry = grams.setdefault(key, [torch.zeros(rows.shape[1], rows.shape[1], **_f64(device)), 0])
                entry[0] += rows.T @ rows
                entry[1] += rows.shape[0]
    finally:
        for name, m in backbone.named_modules():
            m.training = modes.get(name, m.training)
    return {key: (gram, rows) for key, (gram, rows) in grams.items()}


def _f64(device: torch.device) -> dict[str, Any]:
    return {"dtype": torch.float64, "device": device}


class RankMe(Callback):
    """RankMe of the teacher backbone's embeddings (and patch tokens) of the datamodule's held-out images.

    Args:
        every_n_epochs: evaluate after every N-th training epoch (and after the last one).
        evaluate_at_start: also evaluate before the first step of a fresh run: the random-init (or, with
            ``init_from``, the source's) value the run is read against, logged at step 0.
        max_images: at most this many held-out images (evenly spaced) bound the cost; RankMe is at most
            min(N, D), so N should stay well above the embedding width D.
        patch_tokens: also log the patch tokens' RankMe (every token of every image a row).
        batch_size, num_workers: of the feature pass.

    Logs ``rankme/embedding`` and ``rankme/patch``. The held-out images are the datamodule's
    ``heldout_dataset()``: ``data.val_root`` or the ``data.val_fraction`` split, labelled or not. Under DDP
    and FSDP2 each rank embeds a share, in the same number of forwards as every other rank, and the ranks
    sum their Gram matrices, so all log the same value.
    """

    def __init__(
        self,
        every_n_epochs: int = 1,
        evaluate_at_start: bool = True,
        max_images: int = 2048,
        patch_tokens: bool = True,
        batch_size: int = 64,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if every_n_epochs < 1:
            raise UserError(f"RankMe every_n_epochs must be >= 1, got {every_n_epochs}")
        if max_images < 2:
            raise UserError(
                f"RankMe max_images must be >= 2 (a rank of one image says nothing), got {max_images}"
            )
        self.every_n_epochs, self.evaluate_at_start = every_n_epochs, evaluate_at_start
        self.max_images, self.patch_tokens = max_images, patch_tokens
        self.batch_size, self.num_workers = batch_size, num_workers
        self.history: list[dict[str, float]] = []  # {"epoch", "step", "embedding"[, "patch"]} per evaluation
        self._disabled = False

    @property
    def state_key(self) -> str:
        # Two monitors (e.g. different max_images) each keep their history in a checkpoint.
        return self._generate_state_key(max_images=self.max_images, patch_tokens=self.patch_tokens)

    def _dataset(self, trainer: Trainer) -> Dataset | None:
        getter = getattr(trainer.datamodule, "heldout_dataset", None)
        dataset = getter() if callable(getter) and not self._disabled else None
        if dataset is None or len(dataset) < 2:
            if not self._disabled:
                rank_zero_warn(
                    "RankMe monitor disabled: no held-out images (set data.val_fraction, e.g. 0.05, or "
                    "data.val_root; labels are not needed). Training continues without it."
                )
            self._disabled = True
            return None
        if len(dataset) > self.max_images:
            step = len(dataset) / self.max_images
            dataset = Subset(dataset, [int(i * step) for i in range(self.max_images)])
        return dataset

    def evaluate(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, float] | None:
        """``{"embedding": RankMe[, "patch": RankMe]}`` of the evaluated backbone, or None when disabled; the
        same numbers on every rank."""
        dataset = self._dataset(trainer)
        if dataset is None:
            return None
        world, rank = trainer.world_size, trainer.global_rank
        network = getattr(pl_module, "evaluated_network", "teacher")  # a distillation run judges its student
        backbone = getattr(pl_module, network).backbone
        # One contiguous share per rank (a rank may get none), in the same number of forwards on every rank.
        grams = held_out_grams(
            backbone,
            dataset,
            pl_module.device,
            self.batch_size,
            self.num_workers,
            self.patch_tokens,
            rank=rank,
            world_size=world,
        )
        values = {}
        for key in ("embedding", "patch") if self.patch_tokens else ("embedding",):
            gram, rows = grams.get(key, (None, 0))
            if world > 1:
                gram, rows = _sum_over_ranks(trainer.strategy, gram, rows, pl_module.device)
            if rows >= 2:
                values[key] = rankme_from_gram(gram.cpu(), rows)
        epoch = getattr(pl_module, "trained_epoch", trainer.current_epoch)
        step = getattr(pl_module, "trained_step", trainer.global_step)
        self.history.append({"epoch": epoch, "step": step, **values})
        rank_zero_info(
            f"RankMe ({network}) epoch {epoch} step {step}: "
            + ", ".join(f"{key} {value:.1f}" for key, value in values.items())
        )
        return values

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.evaluate_at_start and trainer.global_step == 0:
            values = self.evaluate(trainer, pl_module)
            if values and trainer.is_global_zero:  # self.log is not allowed in on_train_start
                for logger in trainer.loggers:
                    logger.log_metrics({f"rankme/{k}": v for k, v in values.items()}, step=0)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        epoch = trainer.current_epoch + 1
        last = trainer.max_epochs is not None and epoch >= trainer.max_epochs
        if epoch % self.every_n_epochs == 0 or last:
            for key, value in (self.evaluate(trainer, pl_module) or {}).items():
                # Equal on every rank: the mean over ranks is that value, and a checkpoint monitor agrees.
                pl_module.log(f"rankme/{key}", value, on_step=False, on_epoch=True, sync_dist=True)

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))


def _sum_over_ranks(
    strategy: Any, gram: Tensor | None, rows: int, device: torch.device
) -> tuple[Tensor, int]:
    """Every rank's Gram matrix and row count summed, on every rank. A rank without a readable image sends
    zeros of the width the others report (the width travels first)."""
    width = torch.tensor([0 if gram is None else gram.shape[0]], device=device)
    width = int(strategy.reduce(width, reduce_op="max"))
    if gram is None:
        gram = torch.zeros(width, width, **_f64(device))
    total = strategy.reduce(
        torch.cat([gram.flatten(), torch.tensor([float(rows)], **_f64(device))]), reduce_op="sum"
    )
    return total[:-1].reshape(width, width), int(total[-1])
