"""The subpackages of ssl_xcit import one way: each imports only itself and the packages before it in ORDER.

Every ``import`` and ``from ... import`` of every module under ssl_xcit/ counts, those inside functions too (a
lazy import is still an edge: it only moves the cycle to run time). The order, bottom first:

- ``errors``, ``utils``: the package's exceptions and small helpers (files, RNG, compile, transfers);
- ``data`` -> ``models`` -> ``evaluation`` (frozen features, k-NN, linear probes) -> ``retrieval`` (uses the
  evaluation's feature cache) -> ``visualize`` (uses both);
- ``parallel``: FSDP2, meta start, synced BatchNorm, cross-rank step checks, checkpoint IO; no DINO internals;
- ``dino``: the objective and its LightningModule (its lifecycle hooks included);
- ``trainer``: the run around it (callbacks, memory plan, which builds a DINO module on purpose);
- ``cli``.

``ssl_xcit/__init__.py`` and ``ssl_xcit/_renamed.py`` (old module names, resolved by name at import time) sit
below everything and import nothing but each other; ``ssl_xcit/__main__.py`` sits on top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ssl_xcit"

# Bottom first. "ssl_xcit" stands for the top-level modules __init__ and _renamed, "__main__" for __main__.py.
ORDER = [
    "ssl_xcit",
    "errors",
    "utils",
    "data",
    "models",
    "evaluation",
    "retrieval",
    "visualize",
    "parallel",
    "dino",
    "trainer",
    "cli",
    "__main__",
]
RANK = {name: i for i, name in enumerate(ORDER)}


def _layer(module: str) -> str:
    """The entry of ORDER that a dotted module name of ours (``ssl_xcit.dino.module``) belongs to."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__init__", "_renamed"):
        return "ssl_xcit"
    return parts[1]


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of every ssl_xcit module the source imports, at any depth of its syntax tree."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, one level up per extra dot
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target == "ssl_xcit":  # from ssl_xcit import dino: the subpackage is what is imported
                found += [(node.lineno, f"ssl_xcit.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, target))
    return [(line, name) for line, name in found if name.split(".")[0] == "ssl_xcit"]


def wrong_way_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports of ``module`` (given its source) that reach a package above its own in ORDER."""
    own = _layer(module)
    return [
        f"{module}:{line} imports {name} ({_layer(name)} is above {own})"
        for line, name in imported_modules(source, module, is_package)
        if RANK.get(_layer(name), len(ORDER)) > RANK[own]
    ]


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_subpackage_has_its_place_in_the_order():
    found = {_layer(_module_name(path)[0]) for path in _modules()}
    assert found - set(ORDER) == set(), "add the new subpackage to ORDER (and this file's docstring)"


def test_every_import_goes_down_the_order():
    wrong = []
    for path in _modules():
        module, is_package = _module_name(path)
        wrong += wrong_way_imports(path.read_text(encoding="utf-8"), module, is_package)
    assert not wrong, "imports up the order:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "module, source",
    [
        ("ssl_xcit.dino.module", "from ssl_xcit.trainer.callbacks import OnlineKNN"),
        ("ssl_xcit.dino.module", "def f():\n    import ssl_xcit.trainer.memory_plan\n"),
        ("ssl_xcit.dino.module", "from ssl_xcit import trainer"),
        ("ssl_xcit.dino.module", "from ..trainer import memory_plan"),
        ("ssl_xcit.parallel.fsdp", "from ssl_xcit.dino.optim import build_optimizer"),
        ("ssl_xcit.data.crops", "from ssl_xcit.models.vit import x"),
    ],
)
def test_an_import_up_the_order_is_caught(module, source):
    assert len(wrong_way_imports(source, module)) == 1


def test_imports_down_or_within_the_order_pass():
    source = (
        "from ssl_xcit.parallel.fsdp import x\nfrom . import step\nfrom ssl_xcit.errors import UserError\n"
    )
    assert wrong_way_imports(source, "ssl_xcit.dino.module") == []
