#!/usr/bin/env bash
# One GPU check, one command, one table (benchmarks/gpu_check.py describes the rows):
#   bash benchmarks/gpu_check.sh             # on a machine with a CUDA GPU, under 10 minutes on one GPU
#   bash benchmarks/gpu_check.sh --dry-run   # the same rows on the CPU at tiny size
# Exit status 1 when a row fails.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" benchmarks/gpu_check.py "$@"
