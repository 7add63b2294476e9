"""Does DINO learn? Held-out k-NN of the trained teacher against random init and raw pixels, at a fixed budget.

    python benchmarks/learning.py --data synthetic --epochs 8                 # the quickstart's data
    python benchmarks/learning.py --data flowers5 --epochs 10 --batch-size 64
    python benchmarks/learning.py --data cifar10 --epochs 5 --set out_dim=1024 --set centering=sinkhorn_knopp
    python benchmarks/learning.py --recipe recipes/quickstart.yaml            # a recipe's model and data settings
    python benchmarks/learning.py --recipe recipes/quickstart.yaml --distill teacher.pth   # distil instead of DINO

Data: ``synthetic`` (the built-in set: train/ for DINO and the bank, val/ for queries), ``flowers5`` (a fixed
stratified 80/20 split of ``../shared/data/flowers5``), ``camvid`` (CamVid's train photos, unlabelled: no k-NN,
judge the saved backbones with ``bench_segment.py --weights``), ``cifar10`` (``../shared/data/cifar10_12k``: train/ for
DINO and the bank, test/ for queries) or any ImageFolder path (20 % held out). The held-out images are never
trained on. k-NN is DINO's weighted vote (k 20, T 0.07) on the teacher backbone's embedding, with the
datamodule's evaluation transform; raw pixels are the same eval-transformed images, flattened.

``--distill SOURCE`` trains the same student against a frozen teacher (``ssl_xcit.dino.distill.Distill``, the
``features`` objective unless ``--set objective=dino`` or ``dinov3``) with the same optimisation settings; the
k-NN then judges the distilled network (the student, or its EMA under ``dinov3``; ``knn_student`` is always the
student), and each k-NN evaluation records the training seconds spent so far (k-NN time excluded), so runs can
be compared at equal wall time as well as at equal steps. ``--save-ckpt`` writes the whole run (heads included),
a teacher for the ``dino`` and ``dinov3`` objectives.

Prints one table row per run and the collapse signals (teacher entropy and KL to uniform at the end); ``--json``
appends the full result (settings, steps, wall time, k-NN history) to a JSON-lines file.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml
from torch import nn

from ssl_xcit.cli.quiet import install_filters
from ssl_xcit.data.datamodule import DINODataModule
from ssl_xcit.dino.module import DINO
from ssl_xcit.evaluation.embed import embed_dataset
from ssl_xcit.evaluation.knn import weighted_knn
from ssl_xcit.trainer.callbacks import OnlineKNN

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SSL_XCIT_SHARED_DATA", REPO.parent / "shared" / "data"))


def data_kwargs(name: str) -> dict[str, Any]:
    if name == "synthetic":
        return {"root": None}
    if name == "flowers5":
        return {"root": str(SHARED / "flowers5"), "val_fraction": 0.2, "split_seed": 0}
    if name == "camvid":  # CamVid's 367 street photos without their masks (bench_segment.py probes them)
        return {"root": str(SHARED / "camvid" / "train" / "images"), "val_fraction": 0.0}
    if name == "cifar10":
        return {
            "root": str(SHARED / "cifar10_12k" / "train"),
            "val_root": str(SHARED / "cifar10_12k" / "test"),
        }
    return {"root": name, "val_fraction": 0.2, "split_seed": 0}


def parse_value(text: str) -> Any:
    return yaml.safe_load(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data", default="synthetic", help="synthetic | flowers5 | cifar10 | camvid | an ImageFolder path"
    )
    p.add_argument(
        "--no-knn", action="store_true", help="no k-NN (unlabelled data; implied by --data camvid)"
    )
    p.add_argument("--recipe", default=None, help="take model and data settings from this recipe YAML")
    p.add_argument("--epochs", type=int, default=None, help="training epochs (default: the recipe's, else 5)")
    p.add_argument("--limit-batches", type=int, default=None, help="steps per epoch (default: whole epochs)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--knn-every", type=int, default=0, help="k-NN every N epochs (0: only at start and end)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="DINO model argument")
    p.add_argument("--data-set", action="append", default=[], metavar="KEY=VALUE", help="datamodule argument")
    p.add_argument("--json", default=None, help="append the result to this JSON-lines file")
    p.add_argument("--tag", default="", help="a name for this run in the table")
    p.add_argument(
        "--distill",
        default=None,
        metavar="SOURCE",
        help="distil from this frozen teacher (any --model.teacher SOURCE) instead of training DINO",
    )
    p.add_argument(
        "--save",
        default=None,
        help="write the evaluated backbone (DINO's teacher, a distilled student) here (.pth)",
    )
    p.add_argument(
        "--save-ckpt",
        default=None,
        help="also write the whole run as a Lightning checkpoint (.ckpt, heads included: a teacher for the "
        "dino and dinov3 distillation objectives)",
    )
    p.add_argument(
        "--save-every-epoch",
        action="store_true",
        help="also write the teacher backbone after every epoch, as <save>_e<epoch>.pth (steps-versus-quality curves)",
    )
    return p.parse_args(argv)


def settings(args: argparse.Namespace) -> tuple[dict, dict, int]:
    """(model kwargs, datamodule kwargs, epochs) from the recipe (if any), then the command line."""
    model: dict[str, Any] = {}
    data: dict[str, Any] = {}
    epochs = 5
    if args.recipe:
        recipe = yaml.safe_load(Path(args.recipe).read_text())
        model = dict(recipe["model"]["init_args"])
        data = dict(recipe["data"]["init_args"])
        epochs = int(recipe.get("trainer", {}).get("max_epochs", epochs))
    data.update(data_kwargs(args.data) if args.data != "synthetic" or not args.recipe else {})
    for item in args.set:
        key, value = item.split("=", 1)
        model[key] = parse_value(value)
    for item in args.data_set:
        key, value = item.split("=", 1)
        data[key] = parse_value(value)
    if args.batch_size:
        data["batch_size"] = args.batch_size
    data["num_workers"] = args.workers
    data["persistent_workers"] = args.workers > 0
    return model, data, args.epochs or epochs


def knn_top1(model: nn.Module, bank, queries, k: int = 20) -> float:
    """DINO's weighted k-NN top-1 (%) of ``model``'s embedding, T 0.07 (the online monitor's protocol)."""
    b, q = embed_dataset(model, bank), embed_dataset(model, queries)
    scores = weighted_knn(b["features"], b["labels"], q["features"], ks=(k,), temperature=0.07)[k]
    return 100.0 * float((scores.argmax(1) == q["labels"]).float().mean())


def teacher_weights(model: DINO) -> dict[str, Any]:
    """The evaluated backbone's state dict (DINO's teacher, a distillation's student) with its architecture,
    which ``build_backbone(path)`` reads (a plain state dict cannot tell, e.g., a ViT with 8-px patches from the
    registered 16-px one)."""
    network = getattr(model, getattr(model, "evaluated_network", "teacher"))
    return {
        "state_dict": network.backbone.state_dict(),
        "hyper_parameters": {
            "backbone": model.hparams.backbone,
            "backbone_kwargs": model.hparams.backbone_kwargs,
        },
    }


class SaveTeacher(L.Callback):
    """The evaluated backbone (``teacher_weights``) after every epoch, for curves of quality against steps."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        out = self.path.with_name(f"{self.path.stem}_e{trainer.current_epoch + 1}{self.path.suffix}")
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(teacher_weights(pl_module), out)


class TrainClock(L.Callback):
    """Training time so far (batches only: k-NN evaluations and data start-up between epochs excluded),
    added to each k-NN evaluation the monitor records, for comparisons at equal wall time."""

    def __init__(self, knn: OnlineKNN) -> None:
        self.knn = knn
        self.seconds = 0.0
        self._start = 0.0

    def on_train_start(self, *args) -> None:
        self.on_train_epoch_end()  # the step-0 evaluation: no training yet

    def on_train_batch_start(self, *args) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.seconds += time.perf_counter() - self._start

    def on_train_epoch_end(self, *args) -> None:
        for entry in self.knn.history:
            entry.setdefault("train_seconds", self.seconds)


class Signals(L.Callback):
    """Teacher entropy and KL to uniform of every step."""

    def __init__(self) -> None:
        self.entropy: list[float] = []
        self.kl: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if pl_module.last_collapse_signals is not None:
            e, k = pl_module.last_collapse_signals
            self.entropy.append(e)
            self.kl.append(k)


def run(args: argparse.Namespace) -> dict[str, Any]:
    install_filters()  # the same quiet console as `ssl-xcit fit`
    if args.threads:
        torch.set_num_threads(args.threads)
    model_kw, data_kw, epochs = settings(args)
    dm = DINODataModule(**data_kw)
    L.seed_everything(args.seed, verbose=False)
    if args.distill:
        from ssl_xcit.dino.distill import Distill

        model = Distill(teacher=args.distill, **model_kw)
    else:
        model = DINO(**model_kw)
    use_knn = not (args.no_knn or args.data == "camvid")
    knn = OnlineKNN(every_n_epochs=args.knn_every or 10**6, k=20, temperature=0.07, evaluate_at_start=True)
    signals = Signals()
    monitors = [knn, TrainClock(knn)] if use_knn else []
    trainer = L.Trainer(
        max_epochs=epochs,
        limit_train_batches=args.limit_batches,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=monitors
        + [signals]
        + ([SaveTeacher(args.save)] if args.save and args.save_every_epoch else []),
    )
    start = time.perf_counter()
    trainer.fit(model, dm)
    minutes = (time.perf_counter() - start) / 60
    pixels = student_top1 = None
    if use_knn:
        bank, queries = dm.knn_datasets()
        # Raw pixels go through the same extraction path: the "backbone" flattens the eval-transformed image.
        pixels = knn_top1(nn.Flatten(), bank, queries)
        student_top1 = knn_top1(model.student.backbone, bank, queries)
    tail = max(1, len(signals.entropy) // 10)
    result = {
        "tag": args.tag,
        "data": args.data,
        "distill": args.distill,
        "recipe": args.recipe,
        "model": model_kw,
        "datamodule": {k: v for k, v in data_kw.items() if k not in ("root", "val_root")},
        "epochs": epochs,
        "steps": trainer.global_step,
        "train_minutes": round(minutes, 2),
        "knn_random_init": knn.history[0]["top1"] if use_knn else None,
        "knn_dino": knn.history[-1]["top1"] if use_knn else None,
        "knn_raw_pixels": pixels,
        "knn_student": student_top1,
        "knn_history": knn.history,
        "final_entropy": sum(signals.entropy[-tail:]) / tail,
        "final_kl_to_uniform": sum(signals.kl[-tail:]) / tail,
        "entropy_curve": signals.entropy[:: max(1, len(signals.entropy) // 20)],
        "kl_curve": signals.kl[:: max(1, len(signals.kl) // 20)],
        "collapse_events": [cb.events for cb in trainer.callbacks if hasattr(cb, "events")],
        "threads": torch.get_num_threads(),
    }
    knn_text = (
        f"k-NN DINO {result['knn_dino']:.2f} random {result['knn_random_init']:.2f} pixels {pixels:.2f} "
        f"student {student_top1:.2f}"
        if use_knn
        else "no k-NN"
    )
    print(
        f"RESULT {args.tag or '-'} | {args.data} | {trainer.global_step} steps {minutes:.1f} min | {knn_text} | "
        f"entropy {result['final_entropy']:.3f} KL {result['final_kl_to_uniform']:.3f}"
    )
    if args.save:
        # A plain state dict: `build_backbone(path)` infers the variant, so retrieval benchmarks can load it.
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        torch.save(teacher_weights(model), args.save)
    if args.save_ckpt:
        Path(args.save_ckpt).parent.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(args.save_ckpt)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    run(parse_args())
