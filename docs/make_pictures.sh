#!/usr/bin/env bash
# Regenerate every picture in docs/img/ from nothing, on a CPU. Run from the repository root:
#
#   docs/make_pictures.sh                                              # train on flowers5, then draw
#   CKPT=runs/pictures/version_0/checkpoints/last.ckpt docs/make_pictures.sh   # draw from a finished run
#
# 1. Trains DINO on flowers5 (80 % of every class; the other 20 % held out for k-NN) at the best settings of
#    docs/training.md (XCiT-N12/8 cut to 4 blocks, 96-px global / 48-px local crops, batch 32, 6 epochs = 642
#    steps): 22 to 60 min on a 2-core CPU, depending on what else it runs. The run lands in the folder `fit` prints,
#    runs/pictures/version_N (checkpoints/last.ckpt, csv/ metrics).
# 2. Draws attention, PCA and neighbours from that checkpoint (docs/img/*_trained.png) and from the same
#    architecture at random initialisation (docs/img/*_random.png), plus the retrieval example and the curves
#    of the measured quickstart run, and prints the run's held-out k-NN for the captions.
#
# DATA defaults to ../shared/data (or $SSL_XCIT_SHARED_DATA). PNGs are quantised to 256 colours to stay small.
set -euo pipefail
DATA=${SSL_XCIT_SHARED_DATA:-../shared/data}
F=$DATA/flowers5
OUT=docs/img
V=(python -m ssl_xcit visualize)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p runs "$OUT"

if [[ -z "${CKPT:-}" ]]; then
    python -m ssl_xcit fit -c recipes/quickstart.yaml \
        --trainer.max_epochs 6 --trainer.default_root_dir runs/pictures \
        --model.init_args.lr 0.004 --model.init_args.momentum_teacher 0.99 \
        --model.init_args.warmup_teacher_temp 0.01 --model.init_args.teacher_temp 0.01 \
        --data.init_args.root "$F" --data.init_args.val_fraction 0.2 --data.init_args.split_seed 0 \
        --data.init_args.batch_size 32 --data.init_args.global_crops_size 96 --data.init_args.local_crops_size 48 \
        --data.init_args.eval_resize 96 --data.init_args.eval_crop 96 2>&1 | tee runs/pictures.log
    RUN=$(sed -n 's/^run folder: //p' runs/pictures.log | tail -n 1)
    CKPT=$RUN/checkpoints/last.ckpt
fi
RUN=$(dirname "$(dirname "$CKPT")")

# The same backbone (name and truncated depth read from the checkpoint) at random init, seed 0, in the layout
# `ssl-xcit export` writes, so every command below loads both the same way.
RANDOM_INIT=$RUN/random_init.pth
python - "$CKPT" "$RANDOM_INIT" <<'PY'
import sys

import torch

from ssl_xcit.models import create_model

hp = torch.load(sys.argv[1], map_location="cpu", weights_only=True)["hyper_parameters"]
torch.manual_seed(0)
model = create_model(hp["backbone"], **(hp.get("backbone_kwargs") or {}))
meta = {"backbone": hp["backbone"], "backbone_kwargs": dict(hp.get("backbone_kwargs") or {})}
torch.save({"state_dict": model.state_dict(), "hyper_parameters": meta}, sys.argv[2])
PY

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# 128 px: 16x16 patches of 8 px, near the 96-px crops the run trained on (224 px spreads the maps thinner).
IMAGES=("$F/sunflower/1008566138_6927679c8a.jpg" "$F/daisy/100080576_f52e8ee070_n.jpg"
    "$F/tulip/100930342_92e8746431_n.jpg" "$F/rose/10090824183_d02c613f10_m.jpg")
for which in trained random; do
    if [[ $which == trained ]]; then W=$CKPT; else W=$RANDOM_INIT; fi
    "${V[@]}" attention --weights "$W" --size 128 --no-progress --out "$TMP" --dpi 60 "${IMAGES[@]}"
    "${V[@]}" pca --weights "$W" --size 128 --no-progress --out "$TMP" --dpi 60 "${IMAGES[@]}"
    "${V[@]}" neighbours --weights "$W" --train "$F" --per-class 40 --queries "$F" --num-queries 3 --k 6 \
        --size 96 --no-progress --out "$TMP" --dpi 50
    for kind in attention pca neighbours; do mv "$TMP/$kind.png" "$OUT/${kind}_$which.png"; done
done
"${V[@]}" retrieval --arch xcit_nano_12_p16 --dataset ukbench --data-root "$DATA/retrieval_mini/ukbench" \
    --resolution 256 --query 0 4 8 --top 6 --no-progress --out "$OUT" --dpi 60
"${V[@]}" curves tests/visualize/data/quickstart_run --out "$OUT" --dpi 60

python - "$OUT" "$RUN" <<'PY'
import csv
import sys
from pathlib import Path

from PIL import Image

for png in sorted(Path(sys.argv[1]).glob("*.png")):
    Image.open(png).convert("RGB").quantize(256).save(png, optimize=True)
    print(f"{png}: {png.stat().st_size // 1024} KB")
rows = [r for f in sorted(Path(sys.argv[2]).glob("csv/*/metrics.csv")) for r in csv.DictReader(open(f))]
knn = [(int(r["step"]), float(r["knn/top1"])) for r in rows if r.get("knn/top1")]
print(f"{sys.argv[2]}: held-out k-NN top-1 (step, %): " + ", ".join(f"{s}: {v:.1f}" for s, v in knn))
PY
