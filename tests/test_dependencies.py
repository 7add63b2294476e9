"""Every runtime dependency in pyproject.toml is used: imported by the package, or named by a recipe."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # standard library from Python 3.11

ROOT = Path(__file__).resolve().parents[1]
# Distribution name -> import name where they differ.
IMPORT_NAME = {"faiss-cpu": "faiss", "pillow": "PIL", "pyyaml": "yaml", "scikit-learn": "sklearn"}
# Used without an import of their own: LightningCLI parses with jsonargparse; recipes name TensorBoardLogger
# (needs tensorboard) and RichProgressBar (needs rich) by class_path.
INDIRECT = {"jsonargparse": "ssl_xcit/cli", "tensorboard": "TensorBoardLogger", "rich": "RichProgressBar"}


def test_every_runtime_dependency_is_used():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.split(r"[<>=\[;! ]", d, maxsplit=1)[0].lower() for d in deps]
    sources = "\n".join(p.read_text() for p in (ROOT / "ssl_xcit").rglob("*.py"))
    recipes = "\n".join(p.read_text() for p in (ROOT / "recipes").rglob("*.yaml"))
    unused = []
    for name in names:
        if name in INDIRECT:
            if name == "jsonargparse":
                assert "LightningCLI" in sources
            else:
                assert INDIRECT[name] in recipes, f"{name} is kept for {INDIRECT[name]}, which no recipe uses"
            continue
        module = IMPORT_NAME.get(name, name)
        if not re.search(rf"^\s*(import|from) {re.escape(module)}\b", sources, flags=re.M):
            unused.append(name)
    assert unused == [], f"runtime dependencies that nothing imports: {unused}"


def test_torch_floor_has_weights_only_loading():
    # torch.serialization.safe_globals (our checkpoint loading) needs torch 2.5, and torch.load defaults to the
    # weights-only unpickler, which Lightning's resume relies on, from 2.6; torchvision 0.21 pairs with 2.6.
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {}
    for dep in deps:
        match = re.fullmatch(r"([a-z0-9_-]+)>=([0-9.]+)", dep.split(";")[0].strip())
        if match:
            floors[match.group(1)] = tuple(int(p) for p in match.group(2).split("."))
    assert floors["torch"] >= (2, 6) and floors["torchvision"] >= (0, 21), floors


def test_min_versions_script_has_a_floor_to_pin_for_every_requirement():
    """tests/min_versions.sh pins each `>=` floor of [project] dependencies and the [dev] extra: each must be a
    single floor (an upper bound or an exact pin would go untested there), and its default subset must exist."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    script = (ROOT / "tests" / "min_versions.sh").read_text()
    pattern = re.search(r"re\.fullmatch\(r\"(.+?)\", requirement", script).group(1)
    for requirement in project["dependencies"] + project["optional-dependencies"]["dev"]:
        assert re.fullmatch(pattern, requirement.strip()), f"not a single `>=` floor: {requirement!r}"
    subset = re.search(r"set -- (.+?) -q\n", script, flags=re.S).group(1).replace("\\\n", " ").split()
    paths = [arg.split("::")[0] for arg in subset if arg.startswith("tests/")]
    assert paths and all((ROOT / path).exists() for path in paths), subset
