#!/usr/bin/env bash
# One GPU check, one command, one table (benchmarks/gpu_check.py describes the rows):
#   bash benchmarks/gpu_check.sh             # on a machine with a CUDA GPU: at most 8 minutes, each section
#                                            # within its budget; rows also in runs/gpu_check/<time>/rows.jsonl
#   bash benchmarks/gpu_check.sh --dry-run   # the same rows on the CPU at tiny size
# It runs $PYTHON, else the first of the active venv's python, python3 and python that imports the project
# and torch (a bare `python` may be another environment's, or absent where only python3 is).
# Exit status 1 when a row fails, 3 when none failed but some ran out of time, 2 when no such interpreter
# is found.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ -n "${PYTHON:-}" ]]; then
  interpreter=$PYTHON
else
  interpreter=""
  candidates=(python3 python)
  if [[ -n "${VIRTUAL_ENV:-}" ]]; then
    candidates=("$VIRTUAL_ENV/bin/python" "${candidates[@]}")
  fi
  for candidate in "${candidates[@]}"; do
    # ssl_xcit alone would import from this checkout through PYTHONPATH: torch shows the environment has the
    # project's dependencies installed.
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import ssl_xcit, torch" >/dev/null 2>&1; then
      interpreter=$(command -v "$candidate")
      break
    fi
  done
  if [[ -z $interpreter ]]; then
    echo "gpu_check.sh: none of ${candidates[*]} imports ssl_xcit and torch; activate the project's environment or set PYTHON=/path/to/its/python" >&2
    exit 2
  fi
fi
echo "gpu_check.sh: running $interpreter" >&2
exec "$interpreter" benchmarks/gpu_check.py "$@"
