"""RankMe over the steps of ``benchmarks/learning.py`` runs, from the teacher it saved after every epoch.

    python benchmarks/learning.py --data flowers5 ... --tag learn --save runs/learn/t.pth --save-every-epoch \
        --json runs/runs.jsonl
    python benchmarks/rankme_runs.py --data ../shared/data/flowers5 --runs runs/runs.jsonl \
        --weights learn=runs/learn/t.pth --weights collapse=runs/collapse/t.pth --out docs/img/rankme.png

For each tagged run it rebuilds the step-0 teacher (the run's model settings from its JSON line, seed 0, as
``learning.py`` builds it), loads ``<save>_e<N>.pth`` for every epoch N, and computes RankMe of the embeddings
and of the patch tokens (``ssl_xcit.trainer.rankme``) on the held-out images: the same 20 % split ``learning.py``
holds out of an ImageFolder path (``val_fraction`` 0.2, seed 0), with the datamodule's eval transform. Prints a
row per evaluation with the run's k-NN at its start and end, writes the curves as JSON (``--json``) and draws
them (``--out``, a PNG): random init is the step-0 point every run shares.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch

from ssl_xcit.data.datamodule import DINODataModule
from ssl_xcit.dino.module import DINO
from ssl_xcit.models.checkpoint import build_backbone
from ssl_xcit.trainer.rankme import held_out_grams, rankme_from_gram


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="the ImageFolder path the runs trained on (20 %% held out)")
    p.add_argument("--runs", required=True, help="learning.py's --json file (one line per run)")
    p.add_argument(
        "--weights", action="append", required=True, metavar="TAG=SAVE", help="a run's --save path"
    )
    p.add_argument(
        "--eval-size", type=int, default=64, help="eval resize and centre crop (the runs' eval_crop)"
    )
    p.add_argument(
        "--max-images", type=int, default=2048, help="at most this many held-out images (evenly spaced)"
    )
    p.add_argument("--epochs", default=None, help="evaluate only these epochs, e.g. 1,2,4,8 (default: all)")
    p.add_argument("--out", default=None, help="draw the curves into this PNG")
    p.add_argument("--json", default=None, help="write the curves here")
    p.add_argument("--dpi", type=int, default=80)
    return p.parse_args(argv)


def measure(backbone: torch.nn.Module, images: Any) -> dict[str, float]:
    grams = held_out_grams(backbone, images, torch.device("cpu"))
    return {key: rankme_from_gram(gram, rows) for key, (gram, rows) in grams.items()}


def step0_teacher(model_kwargs: dict[str, Any], seed: int = 0) -> torch.nn.Module:
    """The teacher backbone ``learning.py`` starts from: seed, then the DINO of the run's model settings."""
    L.seed_everything(seed, verbose=False)
    return DINO(**model_kwargs).teacher.backbone


def curves(args: argparse.Namespace) -> dict[str, Any]:
    runs = {r["tag"]: r for r in map(json.loads, Path(args.runs).read_text().splitlines()) if r.get("tag")}
    data = DINODataModule(
        root=args.data,
        val_fraction=0.2,
        split_seed=0,
        batch_size=1,
        eval_resize=args.eval_size,
        eval_crop=args.eval_size,
    )
    images = data.heldout_dataset()
    if len(images) > args.max_images:
        images = torch.utils.data.Subset(images, range(0, len(images), len(images) // args.max_images + 1))
    out: dict[str, Any] = {"images": len(images), "runs": {}}
    for spec in args.weights:
        tag, _, save = spec.partition("=")
        run = runs[tag]
        per_epoch = run["steps"] // run["epochs"]
        points = [{"step": 0, **measure(step0_teacher(run["model"]), images)}]
        save = Path(save)
        wanted = range(1, run["epochs"] + 1) if args.epochs is None else map(int, args.epochs.split(","))
        for epoch in wanted:
            path = save.with_name(f"{save.stem}_e{epoch}{save.suffix}")
            points.append({"step": epoch * per_epoch, **measure(build_backbone(path), images)})
        out["runs"][tag] = {"points": points, "knn_start": run["knn_random_init"], "knn_end": run["knn_dino"]}
        for p in points:
            print(
                f"{tag} | step {p['step']} | RankMe embedding {p['embedding']:.2f} | patch {p['patch']:.2f}"
            )
        print(f"{tag} | k-NN step 0 {run['knn_random_init']} | end {run['knn_dino']}")
    return out


def draw(result: dict[str, Any], path: str, dpi: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, key, title in zip(axes, ("embedding", "patch"), ("embedding (CLS)", "patch tokens"), strict=True):
        for tag, run in result["runs"].items():
            steps = [p["step"] for p in run["points"]]
            label = (
                tag
                if run["knn_end"] is None
                else f"{tag} (k-NN {run['knn_start']:.1f} -> {run['knn_end']:.1f} %)"
            )
            ax.plot(steps, [p[key] for p in run["points"]], marker="o", ms=3, label=label)
        start = next(iter(result["runs"].values()))["points"][0][key]
        ax.axhline(start, color="grey", ls="--", lw=1, label="random init (step 0)")
        ax.set_title(f"RankMe of the teacher's {title}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"effective rank ({result['images']} held-out images)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = curves(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.out:
        draw(result, args.out, args.dpi)
    return result


if __name__ == "__main__":
    main()
