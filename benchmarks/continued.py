"""Continued pretraining, measured: one row of docs/training.md's table per command.

    # a row that trains: learning.py's arguments (recipe, data, --set ...), then the evaluations below
    python benchmarks/continued.py --recipe recipes/continue_dinov3.yaml --data flowers5 --epochs 3 \
        --set init_from=runs/source.pth ... --save runs/flowers_recipe.pth --probe --rows rows.jsonl
    # a row that only evaluates: a saved backbone, or "random" (the step-0 teacher of the --set model settings)
    python benchmarks/continued.py --evaluate runs/source.pth --probe --rows rows.jsonl
    python benchmarks/continued.py --evaluate random --set backbone=vit_small_patch16_dinov3 ...

Every row is judged the same way, whatever it trained on, so that a row's gain on its own photos and its loss on
the others are both read:

- **flowers5 k-NN**: DINO's weighted vote (k 20, T 0.07) of the backbone's embedding, the 80 % split as the bank
  and the 864 held-out photos as queries (``learning.py --data flowers5``'s split, never trained on);
- **RankMe** (``ssl_xcit.trainer.rankme``) of the embedding and of the final-norm patch tokens on flowers5's
  held-out photos and on CamVid's 101 val photos (never trained on: the CamVid runs use its train photos);
- **CamVid mIoU** (``--probe``): ``ssl-xcit segment``'s linear probe (DINOv2's protocol at reduced sizes and
  budget, see ``--probe-*``), scored on CamVid val, void ignored.

``--eval-size`` is the side of the evaluation images (resize + centre crop) for k-NN and RankMe; the probe has
its own sizes. Prints one ``ROW`` line; ``--rows`` appends the whole row (training result included) to a JSON-lines file.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import learning  # noqa: E402  (the sibling benchmark: training, k-NN and its data splits)

from ssl_xcit.data.datamodule import DINODataModule  # noqa: E402
from ssl_xcit.dino.module import DINO  # noqa: E402
from ssl_xcit.models.checkpoint import build_backbone  # noqa: E402
from ssl_xcit.trainer.rankme import held_out_grams, rankme_from_gram  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--evaluate",
        default=None,
        metavar="PATH|random",
        help="no training: evaluate this backbone file, or the random-init teacher of the --set settings",
    )
    p.add_argument(
        "--flowers",
        default=str(learning.SHARED / "flowers5"),
        help="the labelled set: 20 %% held out for k-NN",
    )
    p.add_argument(
        "--camvid", default=str(learning.SHARED / "camvid"), help="CamVid: {train,val}/{images,masks}"
    )
    p.add_argument(
        "--eval-size", type=int, default=64, help="k-NN and RankMe image side (the runs' eval_crop)"
    )
    p.add_argument(
        "--rows", default=None, help="append the row (training result included) to this JSON-lines file"
    )
    p.add_argument("--probe", action="store_true", help="also the CamVid segmentation probe")
    p.add_argument("--probe-short-side", type=int, default=180, help="CamVid's half (DINOv2: 512)")
    p.add_argument("--probe-crop", type=int, default=176, help="a multiple of 16 (DINOv2: 512)")
    p.add_argument("--probe-stride", type=int, default=120, help="sliding-window stride (DINOv2: 341)")
    p.add_argument("--probe-iters", type=int, default=300, help="DINOv2: 40,000")
    p.add_argument("--probe-batch", type=int, default=8, help="DINOv2: 16")
    p.add_argument("--probe-lr", type=float, default=1e-2, help="DINOv2: 1e-3 over 40,000 iterations")
    args, rest = p.parse_known_args(argv)
    args.train = learning.parse_args(rest)  # the training arguments (unused with --evaluate but --set)
    return args


def evaluated_backbone(args: argparse.Namespace) -> tuple[torch.nn.Module, dict[str, Any] | None, Path]:
    """(backbone, training result or None, its file), training first unless ``--evaluate``."""
    train = args.train
    if args.evaluate not in (None, "random"):
        return build_backbone(args.evaluate), None, Path(args.evaluate)
    if args.evaluate == "random":
        model_kw, _, _ = learning.settings(train)
        L.seed_everything(train.seed, verbose=False)
        backbone = DINO(**model_kw).teacher.backbone  # the network learning.py's step 0 evaluates
        path = Path(train.save or Path(tempfile.mkdtemp()) / "random.pth")
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"state_dict": backbone.state_dict(),
             "hyper_parameters": {"backbone": model_kw["backbone"],
                                  "backbone_kwargs": model_kw.get("backbone_kwargs") or {}}},
            path,
        )  # fmt: skip
        return backbone, None, path
    if not train.save:
        raise SystemExit(
            "continued.py: a training row needs --save PATH (the probe reads the backbone from it)"
        )
    result = learning.run(train)
    return build_backbone(train.save), result, Path(train.save)


def rankme_of(backbone: torch.nn.Module, dataset: Any) -> dict[str, float]:
    grams = held_out_grams(backbone, dataset, torch.device("cpu"))
    return {key: rankme_from_gram(gram, rows) for key, (gram, rows) in grams.items()}


def evaluate(args: argparse.Namespace, backbone: torch.nn.Module, path: Path) -> dict[str, Any]:
    size = {"eval_resize": args.eval_size, "eval_crop": args.eval_size, "batch_size": 1}  # no training here
    flowers = DINODataModule(**learning.data_kwargs(args.flowers), **size)  # learning.py's 80/20 split
    camvid_root = Path(args.camvid)
    camvid = DINODataModule(
        root=str(camvid_root / "train" / "images"), val_root=str(camvid_root / "val" / "images"), **size
    )
    bank, queries = flowers.knn_datasets()
    out: dict[str, Any] = {
        "knn_flowers5": learning.knn_top1(backbone, bank, queries),
        "rankme_flowers5": rankme_of(backbone, flowers.heldout_dataset()),
        "rankme_camvid": rankme_of(backbone, camvid.heldout_dataset()),
    }
    if args.probe:
        from ssl_xcit.evaluation.segmentation import run_segment

        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            r = run_segment(camvid_root / "train", camvid_root / "val", weights=str(path), ignore_index=11,
                            num_classes=11, iters=args.probe_iters, crop_size=args.probe_crop,
                            stride=args.probe_stride, batch_size=args.probe_batch, lr=args.probe_lr,
                            short_side=args.probe_short_side, num_workers=1, accelerator="cpu",
                            cache_dir=Path(tmp) / "cache", progress=False)  # fmt: skip
        out.update(
            miou_camvid=r["miou"], pixel_acc_camvid=r["pixel_acc"], probe_seconds=time.perf_counter() - start
        )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.train.threads:
        torch.set_num_threads(args.train.threads)
    backbone, result, path = evaluated_backbone(args)
    row = {
        "tag": args.train.tag,
        "evaluate": args.evaluate,
        "training": result,
        **evaluate(args, backbone, path),
    }
    fr, cr = row["rankme_flowers5"], row["rankme_camvid"]
    miou = f" | CamVid mIoU {row['miou_camvid']:.2f}" if args.probe else ""
    steps = f"{result['steps']} steps" if result else "no training"
    print(
        f"ROW {args.train.tag or path.stem} | {steps} | flowers5 k-NN {row['knn_flowers5']:.2f} | RankMe "
        f"flowers5 {fr['embedding']:.1f}/{fr.get('patch', float('nan')):.1f} camvid "
        f"{cr['embedding']:.1f}/{cr.get('patch', float('nan')):.1f}{miou}"
    )
    if args.rows:
        with open(args.rows, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


if __name__ == "__main__":
    main()
