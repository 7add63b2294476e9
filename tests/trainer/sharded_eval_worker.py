"""The online k-NN and RankMe monitors on images that do not split evenly over 2 ranks:
``python sharded_eval_worker.py OUT_DIR STRATEGY[,STRATEGY...]`` under ``torchrun --nproc_per_node 2`` (gloo).

129 images at the monitors' batch 64: each rank embeds a share of 65 and 64 images, 2 batches against 1
unless the ranks keep step. Under ``fsdp2`` every forward of the sharded teacher all-gathers its parameters,
so a rank with a batch more waits in a collective the other never enters (issue 52). Bank image 64 is
unreadable: rank 0's second bank batch holds no readable image, and still has to forward. Each STRATEGY's run
writes OUT_DIR/<strategy>/rank<r>.pt: the gathered k-NN features and labels, the top-1, the RankMe values and
the teacher backbone's whole weights, for ``test_sharded_eval.py`` to recompute in one process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).parent))
from conftest import RandomCrops  # noqa: E402

IMAGES = 129
BATCH = 64
UNREADABLE_BANK = frozenset({64})


class Labelled(Dataset):
    """``n`` deterministic 16-px images, label ``i % 4`` (a weak class signal), ``None`` at ``unreadable``."""

    labelled = True

    def __init__(self, n: int = IMAGES, seed: int = 0, unreadable: frozenset[int] = frozenset()) -> None:
        self.n, self.seed, self.unreadable = n, seed, unreadable

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i in self.unreadable:
            return None
        g = torch.Generator().manual_seed(self.seed * 100_000 + i)
        label = i % 4
        image = torch.randn(3, 16, 16, generator=g)
        image[label % 3] += 0.3 * (float(label) - 1.5)  # weak: top-1 near 50 %, far from 0 and 100
        return image, label, i


def bank() -> Labelled:
    return Labelled(seed=1, unreadable=UNREADABLE_BANK)


def queries() -> Labelled:
    return Labelled(seed=2)


def heldout() -> Labelled:
    return Labelled(seed=3)


class Data(L.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomCrops(4, noise=False), batch_size=2, drop_last=True)

    def knn_datasets(self):
        return bank(), queries()

    def heldout_dataset(self):
        return heldout()


def main(out_dir: Path, strategy: str) -> None:
    from ssl_xcit.dino.module import DINO
    from ssl_xcit.parallel.fsdp import whole_state_dict
    from ssl_xcit.trainer.callbacks import OnlineKNN
    from ssl_xcit.trainer.rankme import RankMe

    class Recorded(OnlineKNN):
        """Keeps what ``_features`` hands the k-NN: the gathered rows of every image, on this rank."""

        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.features: list[tuple[torch.Tensor, torch.Tensor]] = []

        def _features(self, *args, **kwargs):
            out = super()._features(*args, **kwargs)
            self.features.append(out)
            return out

    L.seed_everything(0, verbose=False)
    model = DINO(
        backbone="xcit_nano_12_p8",
        backbone_kwargs={"depth": 1},
        drop_path_rate=0.0,
        out_dim=32,
        head_hidden_dim=32,
        head_bottleneck_dim=16,
        warmup_epochs=0,
        optimizer="sgd",
        lr=0.1,
        freeze_last_layer=0,
    )
    knn = Recorded(batch_size=BATCH, evaluate_at_start=False)
    rankme = RankMe(batch_size=BATCH, evaluate_at_start=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=[knn, rankme],
    )
    trainer.fit(model, datamodule=Data())
    teacher = whole_state_dict(model.teacher.backbone)
    result = {
        "features": knn.features,
        "top1": [h["top1"] for h in knn.history],
        "rankme": rankme.history,
        "teacher": teacher if trainer.global_rank == 0 else None,
    }
    out = out_dir / strategy
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    for name in sys.argv[2].split(","):
        main(Path(sys.argv[1]), name)
