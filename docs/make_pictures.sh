#!/usr/bin/env bash
# Regenerate the README's pictures (docs/img/*.png) from the shipped data, with the exact commands the README
# shows. Run from the repository root:
#
#   docs/make_pictures.sh                                   # random-init xcit_nano_12_p16 (a baseline)
#   WEIGHTS=runs/quickstart/checkpoints/last.ckpt RUN=runs/quickstart docs/make_pictures.sh
#
# DATA defaults to ../shared/data (or $SSL_XCIT_SHARED_DATA). PNGs are quantised to 256 colours to stay small.
set -euo pipefail
DATA=${SSL_XCIT_SHARED_DATA:-../shared/data}
RUN=${RUN:-tests/visualize/data/quickstart_run}
OUT=docs/img
if [[ -n "${WEIGHTS:-}" ]]; then MODEL=(--weights "$WEIGHTS"); else MODEL=(--arch xcit_nano_12_p16); fi
V=(python -m ssl_xcit visualize)
F=$DATA/flowers5

"${V[@]}" attention "${MODEL[@]}" --size 768 "$F/sunflower/1008566138_6927679c8a.jpg" --out $OUT --dpi 70
"${V[@]}" pca "${MODEL[@]}" "$F/sunflower/1008566138_6927679c8a.jpg" "$F/daisy/100080576_f52e8ee070_n.jpg" \
    "$F/tulip/100930342_92e8746431_n.jpg" --out $OUT --dpi 60
"${V[@]}" neighbours "${MODEL[@]}" --train "$F" --per-class 40 --queries "$F" --num-queries 3 --k 6 \
    --size 128 --out $OUT --dpi 50
"${V[@]}" retrieval "${MODEL[@]}" --dataset ukbench --data-root "$DATA/retrieval_mini/ukbench" --resolution 256 \
    --query 0 4 8 --top 6 --out $OUT --dpi 60
"${V[@]}" curves "$RUN" --out $OUT --dpi 60
python - "$OUT" <<'PY'
import sys
from pathlib import Path
from PIL import Image

for png in sorted(Path(sys.argv[1]).glob("*.png")):
    Image.open(png).convert("RGB").quantize(256).save(png, optimize=True)
    print(f"{png}: {png.stat().st_size // 1024} KB")
PY
